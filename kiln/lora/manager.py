"""`LoRAManager`: which adapter each slot holds and which adapters are kept read in host memory, both least recently
used first out (vLLM's `--max-loras` slots and `--max-cpu-loras` host copies).

Per step `step_slots` gives each sequence's slot from its adapter id: an adapter already in a slot keeps it, another
is copied into a free slot or the least recently used one this step does not need (read again from its path when
its host copy was dropped). A step may name at most `max_loras` adapters (the scheduler's bound). Everything it does
is counted (`LoRACounters`), as the compiler's work is.

On several devices rank 0 decides and the other ranks copy: each slot load is numbered (`SlotLoad`), the step's
plan carries the loads made while it was planned (`take_loads`), and every rank runs `follow` on them before the
step's forward, reading the adapter from its path into the same slot (its part of it: kiln.lora.targets), as vLLM's
workers read an adapter themselves. A rank that made the load itself (rank 0; every rank when each plans the same
steps) finds the number it already holds and does nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.errors import ConfigError
from kiln.lora.checkpoint import LoRAAdapter, read_adapter
from kiln.lora.layer import BASE_ONLY
from kiln.lora.request import LoRARequest
from kiln.lora.slots import LoRASlots
from kiln.lora.validate import check_adapter


@dataclass(frozen=True)
class SlotLoad:
    """Adapter `path` copied into `slot`, the engine's `number`-th slot load (what the other ranks repeat)."""

    slot: int
    number: int
    path: str


@dataclass
class LoRACounters:
    slot_loads: int = 0  # adapters copied into a slot
    slot_evictions: int = 0  # ... replacing another adapter (least recently used)
    host_reads: int = 0  # adapter directories read from disk
    host_evictions: int = 0  # host copies dropped (least recently used past max_cpu_loras)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def expect(self, **expected: int) -> None:
        """Raise AssertionError when a named counter differs from `expected`."""
        got = {name: getattr(self, name) for name in expected}
        if got != expected:
            raise AssertionError(f"LoRA counters {got}, expected {expected}")


class LoRAManager:
    def __init__(
        self, slots: LoRASlots, max_cpu_loras: int, read: Callable[[str | Path], LoRAAdapter] = read_adapter
    ) -> None:
        if max_cpu_loras < slots.limits.max_loras:
            raise ConfigError(
                f"--max-cpu-loras {max_cpu_loras} is below --max-loras {slots.limits.max_loras}: every adapter in a "
                "slot keeps its host copy"
            )
        self.slots, self.max_cpu_loras, self.read = slots, max_cpu_loras, read
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by id
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self.active: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self.counters = LoRACounters()
        self.held: dict[int, int] = {}  # slot -> the number of the load it holds
        self.planned: list[SlotLoad] = []  # the loads since the last take_loads

    def add(self, request: LoRARequest) -> None:
        """Register the adapter, read and checked against the model now (AdapterError naming the file and field;
        nothing changes then). Adding an id again with the same name and path is a no-op."""
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise ConfigError(f"LoRA id {request.lora_int_id} is already {known.lora_name} ({known.lora_path})")
            return
        adapter = self._read(request)
        self.requests[request.lora_int_id] = request
        self._keep(request.lora_int_id, adapter)

    def by_name(self, name: str) -> LoRARequest | None:
        """The registered adapter called `name` (None: none is). The server asks from its own thread: the values are
        copied in one call (atomic under the GIL) before they are read."""
        return next((r for r in list(self.requests.values()) if r.lora_name == name), None)

    def remove(self, lora_id: int) -> None:
        """Forget the adapter: its slot is cleared and its host copy dropped."""
        if self.requests.pop(lora_id, None) is None:
            raise ConfigError(f"LoRA id {lora_id} is not loaded")
        self.host.pop(lora_id, None)
        slot = self.active.pop(lora_id, None)
        if slot is not None:
            self.slots.clear(slot)
            self.held.pop(slot, None)

    def step_slots(self, lora_ids: Sequence[int | None]) -> list[int]:
        """Each sequence's slot (BASE_ONLY for None), copying adapters into slots as needed."""
        needed = set(lora_ids) - {None}
        if len(needed) > self.slots.limits.max_loras:
            raise ConfigError(f"a step with {len(needed)} adapters: the engine holds {self.slots.limits.max_loras}")
        in_order = dict.fromkeys(i for i in lora_ids if i is not None)  # first seen first: a deterministic LRU
        slot_of = {lora_id: self._activate(lora_id, needed) for lora_id in in_order}
        return [BASE_ONLY if i is None else slot_of[i] for i in lora_ids]

    def _activate(self, lora_id: int, needed: set[int | None]) -> int:
        if lora_id in self.active:
            self.active.move_to_end(lora_id)
            return self.active[lora_id]
        if lora_id not in self.requests:
            raise ConfigError(f"LoRA id {lora_id} is not loaded")
        used = set(self.active.values())
        free = [s for s in range(self.slots.limits.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.active if i not in needed)
            slot = self.active.pop(victim)
            self.counters.slot_evictions += 1
        adapter = self.host.get(lora_id)
        if adapter is None:
            adapter = self._read(self.requests[lora_id])
        self._keep(lora_id, adapter)
        self.slots.load(slot, adapter)
        self.counters.slot_loads += 1
        self.held[slot] = self.counters.slot_loads
        self.planned.append(SlotLoad(slot, self.counters.slot_loads, adapter.path))
        self.active[lora_id] = slot
        return slot

    def take_loads(self) -> list[SlotLoad]:
        """The slot loads made since the last call (a step's, for its plan)."""
        loads, self.planned = self.planned, []
        return loads

    def follow(self, loads: Sequence[SlotLoad]) -> None:
        """Make each load another rank made (module docstring): the adapter read from its path again, checked (an
        AdapterError when the file changed under it) and copied into its slot; a load this rank holds is skipped."""
        for load in loads:
            if self.held.get(load.slot) == load.number:
                continue
            adapter = self.read(load.path)
            self.counters.host_reads += 1
            self.slots.load(load.slot, adapter)
            self.counters.slot_loads += 1
            self.held[load.slot] = load.number

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.read(request.lora_path)
        limits = self.slots.limits
        check_adapter(adapter, self.slots.targets, limits.max_rank, allowed=limits.target_modules)
        self.counters.host_reads += 1
        return adapter

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Keep (or refresh) the host copy; past max_cpu_loras drop the least recently used one not in a slot."""
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.max_cpu_loras:
            victim = next((i for i in self.host if i not in self.active and i != lora_id), None)
            if victim is None:
                break
            del self.host[victim]
            self.counters.host_evictions += 1
