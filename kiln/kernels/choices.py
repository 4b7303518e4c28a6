"""Kernel choices are timed on the machine that runs them, once, and cached per machine.

A choice is a small JSON record (the candidates' times and the winner) stored in `<cache_dir>/kernel_choices.json`
under a key made of what was chosen for (a name and the shape/dtype it applies to) and the machine: CPU model,
its ISA flags, torch version and thread count. Another CPU, another torch or another thread count times the
candidates again; nothing is assumed from the box the code was written on.

Rule: one process makes each choice once. Every engine of the process (the server's, the debugger's several,
a test's) reads the first one made, whatever its cache dir: two engines over one model always pick the same
layouts, so their graphs hash alike. The file is written on every dir that a choice is asked of, so the next
process starts warm there too. Processes sharing a dir take turns per choice (a lock file for each): one times it
while another that needs it waits and reads it (tensor-parallel ranks over one layout), and no write drops a choice
another process made (the file's own lock). Different choices are timed side by side: a process does not wait for
another's unrelated table.

Timings stream the weights the way a decode step does: each candidate runs over copies of the weight that add up
to more than the last-level cache, so a product reads DRAM instead of a warm cache (a toy model's weights, which sit
in cache when they run, are timed over MAX_COPIES copies).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("kiln")

CHOICES_FILE = "kernel_choices.json"
LOCK_FILE = "kernel_choices.lock"  # held while the file is rewritten
KEY_LOCKS = "kernel_choices.locks"  # <key>.lock: held while that choice is timed
STREAM_BYTES = 256 << 20  # more than any last-level cache kiln runs on: timed products read DRAM
# NOTE: but no more copies than this: 512 copies of a weight fit a cache only where the whole model is a toy that sits
# in cache when it runs too, and the copies of toy weights cost most of a test: 19,000 of a 64x64 4-bit layer (clones,
# torch's int4 repacking of each) took 20 s of a 54 s packed kernel table, 524,288 of a 128-byte MoE weight 23 s of a
# layout choice (2-core EPYC). SmolLM2's weights take 3 to 390 copies.
MAX_COPIES = 512


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags": the ISA extensions the CPU has and
    the kernel enabled); empty where there is no /proc/cpuinfo. Read once per process (a copy each call)."""
    return dict(_read_cpu_info())


@functools.cache
def _read_cpu_info() -> tuple[tuple[str, str], ...]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return tuple(info.items())


def machine_fingerprint() -> dict[str, Any]:
    """CPU model, a hash of its ISA flags, torch version and intra-op threads."""
    info = cpu_info()
    model = info.get("model name") or platform.processor() or platform.machine()  # not Linux: the platform's name
    flags = info.get("flags", "")
    return {
        "cpu": model,
        "isa": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


# the choices this process made or read, by key (which holds the machine): shared by every engine it builds
_PROCESS_CHOICES: dict[str, dict[str, Any]] = {}
_HELD: dict[Path, int] = {}  # lock files this process holds, and how deep
_THREADS = threading.RLock()  # the lock's holder within the process


def forget_process_choices() -> None:
    """Drop the choices this process holds, so the next ones are read from disk or timed again (for tests of the
    timing itself; an engine never needs it)."""
    _PROCESS_CHOICES.clear()


class KernelChoiceCache:
    """Timed choices by key, in one JSON file: read again for each choice this process does not hold yet (another
    process may have timed it since), rewritten whole, atomically, on a new choice."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / CHOICES_FILE
        self.machine = machine_fingerprint()

    def choose(self, name: str, applies_to: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The record for (`name`, `applies_to`, this machine): this process's, else this cache dir's, else
        `measure()`'s, stored. The record gains `"source": "process" | "cache" | "timed"`."""
        key = hashlib.sha256(json.dumps([name, applies_to, self.machine], sort_keys=True).encode()).hexdigest()[:24]
        held = _PROCESS_CHOICES.get(key)
        if held is not None:
            if key not in self._read():
                with self._locked():
                    self._write({**self._read(), key: held})
            return {**_public(held), "source": "process"}
        records = self._read()
        if key not in records:
            with self._locked(f"{KEY_LOCKS}/{key}.lock"):  # another process timing it: wait, then read its record
                records = self._read()
                if key not in records:
                    record = measure()
                    stored = {**record, "name": name, "applies_to": applies_to, "machine": self.machine}
                    _PROCESS_CHOICES[key] = stored
                    with self._locked():
                        self._write({**self._read(), key: stored})
                    return {**record, "source": "timed"}
        _PROCESS_CHOICES[key] = records[key]
        return {**_public(records[key]), "source": "cache"}

    def forget_this_machine(self) -> int:
        """Drop every choice timed on this CPU (any torch, any thread count) from the file, so the next start times
        them again (after a first start that other work slowed down); other machines' choices stay. How many."""
        with self._locked():
            records = self._read()
            mine = {k for k, r in records.items() if _same_cpu(r.get("machine"), self.machine)}
            if mine:
                self._write({k: r for k, r in records.items() if k not in mine})
        for key in mine:
            _PROCESS_CHOICES.pop(key, None)
        return len(mine)

    @contextmanager
    def _locked(self, name: str = LOCK_FILE) -> Iterator[None]:
        """Hold the lock file `name` beside the choices (default: the file's own lock, for a read-merge-write that
        drops no choice another process wrote since its read; a choice's: one process times it at a time, so engines
        starting together, e.g. tensor-parallel ranks, do not time it twice). Re-entrant in a process; where the lock
        file cannot be made (a read-only cache), no lock."""
        lock = self.path.parent / name
        with _THREADS:
            if _HELD.get(lock, 0):
                _HELD[lock] += 1
                try:
                    yield
                finally:
                    _HELD[lock] -= 1
                return
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                yield
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                _HELD[lock] = 1
                yield
            finally:
                _HELD.pop(lock, None)
                os.close(fd)  # closing the descriptor releases the lock

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, records: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as exc:  # a read-only cache costs a re-measure next start, nothing else
            logger.warning("Could not save kernel choices to %s (%s): they are timed again next start", self.path, exc)


def _same_cpu(machine: object, this: dict[str, Any]) -> bool:
    return isinstance(machine, dict) and (machine.get("cpu"), machine.get("isa")) == (this["cpu"], this["isa"])


def _public(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored record without the key's parts (what `measure()` returned)."""
    return {k: v for k, v in stored.items() if k not in ("name", "applies_to", "machine")}


def stream_count(nbytes: int, total: int = STREAM_BYTES) -> int:
    """How many separate copies of `nbytes` add up to at least `total` bytes (two at least, MAX_COPIES at most)."""
    return min(max(2, -(-total // nbytes)), MAX_COPIES)


def streamed_copies(weight: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """`make(weight)` copies adding up to at least STREAM_BYTES (each a separate allocation)."""
    count = stream_count(weight.numel() * weight.element_size())
    return [make(weight.detach().clone()) for _ in range(count)]


def time_per_call_us(call: Callable[[torch.Tensor], object], weights: list[torch.Tensor], sweeps: int = 3) -> float:
    """Best over `sweeps` of the mean time of `call(w)` across `weights` (one warm-up sweep first), in µs."""
    for w in weights:
        call(w)
    best = float("inf")
    for _ in range(sweeps):
        start = time.perf_counter()
        for w in weights:
            call(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e6
