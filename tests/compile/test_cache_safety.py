"""The compile cache under pressure: concurrent writers, failed stores, untrusted folders, tampered entries.

No compiler runs here: entries are written by small callbacks (and, for the piece store, a recording compiler), so
every test takes well under a few seconds; the race spawns real processes.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import time
import traceback
from functools import partial
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch._inductor import cpu_vec_isa

from kiln.compile.cache import ARTIFACT, CacheKey, CompileCache, make_key
from kiln.compile.counters import CompileCounters

if TYPE_CHECKING:
    from kiln.compile.compiler import PieceCompiler
    from kiln.compile.store import CompiledPieceStore

KEY = CacheKey(
    structure="piece", compiler="test", options="{}", recipe_hash="abc", torch_version=torch.__version__, device="cpu"
)
NUM_WRITERS = 3
NUM_ROUNDS = 5


def _content(writer: int, round_: int) -> bytes:
    return f"writer {writer} round {round_}\n".encode() * 4096


def _slow_write(content: bytes, path: Path) -> None:
    """Write `content` in four parts with pauses, so concurrent writers overlap mid-write."""
    quarter = len(content) // 4
    with path.open("wb") as f:
        for start in range(0, len(content), quarter):
            f.write(content[start : start + quarter])
            f.flush()
            time.sleep(0.02)


def _race_worker(root: str, writer: int, barrier: Barrier, results: Queue) -> None:
    """Store KEY in step with the other writers each round, then check what every writer now finds."""
    try:
        cache = CompileCache(Path(root), CompileCounters())
        rounds = []
        for round_ in range(NUM_ROUNDS):
            barrier.wait(timeout=60)
            stored = cache.store(KEY, partial(_slow_write, _content(writer, round_)))
            barrier.wait(timeout=60)
            found = cache.lookup(KEY)
            complete = {_content(w, round_) for w in range(NUM_WRITERS)}
            rounds.append((stored is not None, found is not None and found.read_bytes() in complete))
        results.put((writer, rounds))
    except BaseException:
        results.put((writer, traceback.format_exc()))


def _names(cache: CompileCache) -> list[str]:
    return sorted(p.name for p in cache.root.iterdir())


def test_concurrent_stores_of_one_entry(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(NUM_WRITERS), ctx.Queue()
    workers = [ctx.Process(target=_race_worker, args=(str(tmp_path), w, barrier, results)) for w in range(NUM_WRITERS)]
    for worker in workers:
        worker.start()
    outcomes = dict(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
    assert [worker.exitcode for worker in workers] == [0] * NUM_WRITERS
    for writer, rounds in outcomes.items():
        assert not isinstance(rounds, str), f"writer {writer} raised:\n{rounds}"
        # (stored, found one writer's complete content) for every round
        assert rounds == [(True, True)] * NUM_ROUNDS, f"writer {writer}"
    cache = CompileCache(tmp_path, CompileCounters())
    found = cache.lookup(KEY)
    assert found == cache.entry_dir(KEY) / ARTIFACT
    assert found.read_bytes() in {_content(w, NUM_ROUNDS - 1) for w in range(NUM_WRITERS)}
    assert _names(cache) == [KEY.digest]  # no temp or discarded folder left behind
    assert cache.counters.cache_rejected == 0


def test_leftover_temp_folder_is_not_an_entry(tmp_path: Path) -> None:
    """A killed writer leaves a complete-looking temp folder; lookup must not take it for the entry."""
    cache = CompileCache(tmp_path, CompileCounters())
    cache.store(KEY, lambda p: p.write_bytes(b"killed writer"))
    cache.entry_dir(KEY).rename(cache.root / f"{KEY.digest}.tmp.killed")
    assert cache.lookup(KEY) is None
    assert cache.store(KEY, lambda p: p.write_bytes(b"next writer")) == cache.entry_dir(KEY) / ARTIFACT
    assert cache.lookup(KEY).read_bytes() == b"next writer"


def _disk_full(path: Path) -> None:
    path.write_bytes(b"half")
    raise OSError(errno.ENOSPC, "No space left on device")


def _failing_rename(self: Path, target: Path) -> None:
    raise OSError(errno.EROFS, "Read-only file system")


@pytest.mark.parametrize("failure", ["write", "swap"])
def test_failed_store_is_logged_and_skipped(
    failure: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CompileCache(tmp_path, CompileCounters())
    write = _disk_full if failure == "write" else (lambda p: p.write_bytes(b"complete"))
    if failure == "swap":
        monkeypatch.setattr(Path, "rename", _failing_rename)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert cache.store(KEY, write) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    reason = "No space left on device" if failure == "write" else "Read-only file system"
    assert len(warnings) == 1 and str(cache.entry_dir(KEY)) in warnings[0] and reason in warnings[0]
    assert _names(cache) == []  # neither an entry nor a temp folder


def _piece_store(root: Path, save_error: Exception | None = None) -> tuple[CompiledPieceStore, PieceCompiler]:
    """A piece store over a compiler that records loads (and fails every one, so nothing is imported)."""
    # NOTE: imported here, not at the top: the race's spawned workers import this module and should not pay
    # for the compile stack they never use.
    from kiln.compile.compiler import CompiledPiece, PieceCompiler
    from kiln.compile.store import CompiledPieceStore

    class RecordingCompiler(PieceCompiler):
        name = "recording"
        has_artifact = True

        def __init__(self) -> None:
            self.loaded: list[Path] = []

        def compile(self, graph: torch.fx.GraphModule, static_size: int | None = None) -> CompiledPiece:
            return CompiledPiece(graph.forward, None, artifact=b"generated code")

        def save(self, compiled: CompiledPiece, path: Path) -> None:
            if save_error is not None:
                raise save_error
            path.write_bytes(compiled.artifact)

        def load(self, path: Path, graph: torch.fx.GraphModule) -> CompiledPiece:
            self.loaded.append(path)
            raise RuntimeError("the test compiler loads nothing")

    compiler = RecordingCompiler()
    return CompiledPieceStore(compiler, root, "abc", [], torch.device("cpu"), CompileCounters()), compiler


def _graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.ReLU())


def test_compiler_save_that_raises_does_not_stop_the_engine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, _ = _piece_store(tmp_path, save_error=TypeError("cannot pickle 'generator' object"))
    graph = _graph()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        piece = store.get(graph, "piece 0", key="piece")
    assert piece.fn == graph.forward  # the fresh compile is used
    assert "TypeError: cannot pickle 'generator' object" in caplog.text
    assert list((tmp_path / "compile").iterdir()) == []


def test_manifest_is_checked_before_the_artifact_is_loaded(tmp_path: Path) -> None:
    store, compiler = _piece_store(tmp_path)
    store.get(_graph(), "piece 0", key="piece")
    (entry,) = (tmp_path / "compile").iterdir()
    store, compiler = _piece_store(tmp_path)
    store.get(_graph(), "piece 0", key="piece")
    assert compiler.loaded == [entry / ARTIFACT]  # an intact entry reaches the compiler's load
    store, compiler = _piece_store(tmp_path)  # that load failed: the entry was rebuilt
    (entry / ARTIFACT).write_bytes(b"tampered code")
    store.get(_graph(), "piece 0", key="piece")
    assert compiler.loaded == []
    store.counters.expect(cache_rejected=1, pieces_compiled=1, cache_hits=0)


def test_fresh_cache_folder_is_private(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # a plain mkdir would now give 0777
    try:
        cache = CompileCache(tmp_path / "new" / "kiln", CompileCounters())
    finally:
        os.umask(old_umask)
    assert (cache.root.stat().st_mode & 0o777) == 0o700
    assert cache.store(KEY, lambda p: p.write_bytes(b"code")) is not None


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777], ids=lambda mode: f"{mode:04o}")
def test_writable_cache_folder_is_refused(mode: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    CompileCache(tmp_path, CompileCounters()).store(KEY, lambda p: p.write_bytes(b"code"))
    root = tmp_path / "compile"
    root.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cache = CompileCache(tmp_path, CompileCounters())
    assert caplog.records[-1].levelno == logging.WARNING
    warning = caplog.records[-1].getMessage()
    assert str(root) in warning and f"writable by group or others (mode {mode:04o})" in warning
    assert f"chmod 700 {root}" in warning
    assert cache.lookup(KEY) is None  # a valid entry is there, but not trusted
    assert cache.store(KEY, lambda p: p.write_bytes(b"other code")) is None
    assert _names(cache) == [KEY.digest] and (cache.entry_dir(KEY) / ARTIFACT).read_bytes() == b"code"


def test_cache_folder_of_another_user_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    CompileCache(tmp_path, CompileCounters()).store(KEY, lambda p: p.write_bytes(b"code"))
    owner = (tmp_path / "compile").stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1000)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cache = CompileCache(tmp_path, CompileCounters())
    assert f"owned by uid {owner}, not by this process's uid {owner + 1000}" in caplog.text
    assert "--cache-dir" in caplog.text
    assert cache.lookup(KEY) is None
    assert cache.store(KEY, lambda p: p.write_bytes(b"other code")) is None
    assert (cache.entry_dir(KEY) / ARTIFACT).read_bytes() == b"code"


def test_a_cpu_key_names_the_vector_isa_and_the_threads_the_code_was_split_for() -> None:
    """Inductor writes C++ for one vector ISA and decides at compile time which loops fork, from the thread count: a
    piece compiled by a one-thread rank (serial loops) is not the one a two-thread engine loads."""
    before = torch.get_num_threads()
    keys = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            keys.append(make_key("piece", "inductor", {}, "abc", torch.device("cpu")))
    finally:
        torch.set_num_threads(before)
    assert keys[0].digest != keys[1].digest
    assert keys[0].device == f"cpu:{cpu_vec_isa.pick_vec_isa()}:1-threads" and keys[1].device.endswith(":2-threads")
