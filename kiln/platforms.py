"""Device differences in one place: a `Platform` per device type (CPU, CUDA), found by `platform_of(device)`.

The rest of kiln asks its device's platform (can it record graphs? how much memory is free? which collective
backend?) instead of testing `device.type == "cuda"` where it stands. Graph mode keeps one interface on both
devices (kiln.compile.capture); what differs is stated here, once:
- `records_graphs`: CUDA records a capture's kernels and replays them (CUDA graphs), so a capture must not read
  host-side values and its inputs keep fixed shapes; on CPU a capture is the piece specialised to one size.
- `separate_memory`: the device has memory of its own, so step inputs are staged in pinned host memory and
  uploaded once per step; on CPU the staging buffer is the input.
- `kv_cache_zeros`: where a KV cache lies: on CPU on transparent huge pages where Linux gives them
  (kiln.huge_pages), on CUDA in device memory.
A new device type is one subclass and one `PLATFORMS` entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import psutil
import torch

from kiln import huge_pages
from kiln.errors import ConfigError


class Platform(ABC):
    name: ClassVar[str]
    records_graphs: ClassVar[bool]
    separate_memory: ClassVar[bool]
    collective_backend: ClassVar[str]  # torch.distributed's backend for the tensor-parallel groups

    @abstractmethod
    def is_available(self) -> bool:
        """Whether torch sees a device of this type here."""

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def available_memory_gb(self, device: torch.device) -> float:
        """Memory free for the KV cache and the captures now (the weights already loaded)."""

    def capability(self) -> tuple[tuple[int, int] | None, str]:
        """(compute capability, name) of device 0, for a recipe's `hardware.arch`; (None, "") where there is none."""
        return None, ""

    def cache_name(self, device: torch.device) -> str:
        """The device as compiled-piece cache keys name it: code compiled for one must not load on another."""
        return device.type

    def synchronize(self, device: torch.device) -> None:
        """Wait for the work queued on `device` (a timing's bounds); CPU work is done when the call returns."""
        return None

    def new_graph_pool(self) -> Any:
        """One memory pool shared by every graph an engine records (None where graphs are not recorded)."""
        return None

    def is_capturing(self) -> bool:
        """Whether a graph is being recorded now (ops that branch on values must take their graph-safe form)."""
        return False

    def bind_rank(self, rank: int) -> torch.device:
        """The device rank `rank` of a multi-device engine runs on (made current where that matters)."""
        return torch.device(self.name)

    def warm_collectives(self, group: Any) -> None:
        """Set a group's communicators up before any capture (NCCL does it on first use, which a capture forbids)."""
        return None

    def kv_cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A layer's zeroed KV cache, placed where its scattered blocks read fastest."""
        return torch.zeros(shape, dtype=dtype, device=device)


class CpuPlatform(Platform):
    name = "cpu"
    records_graphs = False
    separate_memory = False
    collective_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def available_memory_gb(self, device: torch.device) -> float:
        return psutil.virtual_memory().available / 1e9

    def cache_name(self, device: torch.device) -> str:
        """The vector ISA inductor writes C++ for and the threads it splits loops for, beside the device: code for
        AVX-512 must not load on a CPU without it, and inductor decides at compile time which loops run in parallel
        from the thread count (a piece compiled by a one-thread tensor-parallel rank runs serial loops, one compiled
        with two threads forks for a 576-wide RoPE: both were loaded by the other before the threads were keyed)."""
        from torch._inductor import cpu_vec_isa

        return f"cpu:{cpu_vec_isa.pick_vec_isa()}:{torch.get_num_threads()}-threads"

    def kv_cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """On transparent huge pages where Linux gives them (kiln.huge_pages: one TLB entry covers 512 blocks)."""
        return huge_pages.zeros(shape, dtype)


class CudaPlatform(Platform):
    name = "cuda"
    records_graphs = True
    separate_memory = True
    collective_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def available_memory_gb(self, device: torch.device) -> float:
        return torch.cuda.mem_get_info(device)[0] / 1e9

    def capability(self) -> tuple[tuple[int, int] | None, str]:
        if not torch.cuda.is_available():
            return None, ""
        major, minor = torch.cuda.get_device_capability(0)
        return (major, minor), torch.cuda.get_device_name(0)

    def cache_name(self, device: torch.device) -> str:
        return f"cuda:{torch.cuda.get_device_name(device)}:{torch.version.cuda}"

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def new_graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def bind_rank(self, rank: int) -> torch.device:
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        return torch.device(f"cuda:{torch.cuda.current_device()}")

    def warm_collectives(self, group: Any) -> None:
        torch.distributed.all_reduce(torch.zeros(1, device="cuda"), group=group)


PLATFORMS: dict[str, Platform] = {p.name: p for p in (CpuPlatform(), CudaPlatform())}


def platform_of(device: torch.device | str) -> Platform:
    """The platform of `device` (a torch.device, or a name such as "cuda" or "cuda:1")."""
    try:
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    except RuntimeError:  # torch's own word for a name it cannot parse
        kind = str(device)
    if kind not in PLATFORMS:
        raise ConfigError(f"device type {kind!r} is not supported: expected one of {', '.join(PLATFORMS)}")
    return PLATFORMS[kind]
