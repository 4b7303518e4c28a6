"""Captures: a piece fixed to one num_tokens, with static input and output buffers.

Same interface and the same aliasing rules on both devices, so memory bugs of CUDA graphs reproduce on CPU:
- CUDA: a `torch.cuda.CUDAGraph` recorded in one pool shared by every capture; replay re-runs its kernels.
- CPU (CUDA graphs do not exist): the compiled piece called directly on its static buffers — no dynamo
  guards, no argument re-binding, parameters and num_tokens bound once — then copied into static outputs.

Outputs stay valid until the capture's next replay. An input that is already the static buffer (the
previous captured piece's output, adopted at capture time) is not copied.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.distributed.ops import live_collectives
from kiln.errors import KilnError
from kiln.platforms import platform_of

PieceFn = Callable[..., Sequence[torch.Tensor]]


class Capture(ABC):
    def __init__(self, fn: PieceFn, args: Sequence[Any], dynamic_args: Sequence[int], adopt: set[int]) -> None:
        """`dynamic_args`: indices of the tensors sized by num_tokens; `adopt`: ids of tensors that are
        already static (outputs of earlier captures) and become this capture's input buffers as they are."""
        self.fn = fn
        self.args = list(args)
        self.inputs: list[tuple[int, torch.Tensor]] = []
        for i in dynamic_args:
            value = args[i]
            buf = value if id(value) in adopt else value.clone()
            self.args[i] = buf
            self.inputs.append((i, buf))
        self.bound_pointers = [(i, a.data_ptr()) for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        self.outputs: list[torch.Tensor] = []
        self.latency_s = float("nan")

    def __call__(self, args: Sequence[Any]) -> list[torch.Tensor]:
        for i, buf in self.inputs:
            src = args[i]
            if src is not buf:
                buf.copy_(src)
        self.replay()
        return self.outputs

    @abstractmethod
    def replay(self) -> None: ...

    @property
    def static_bytes(self) -> int:
        tensors = [b for _, b in self.inputs] + self.outputs
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_bound_inputs(self, where: str) -> None:
        """Trace-mode check before a replay: every tensor the capture reads (parameters and static input
        buffers) is still at the address it had at capture time, and each input is copied into that buffer."""
        for i, ptr in self.bound_pointers:
            if self.args[i].data_ptr() != ptr:
                raise CaptureAddressError(
                    f"{where}: input {i} moved since capture ({ptr:#x} -> {self.args[i].data_ptr():#x}); "
                    "parameters must not be reassigned after graph capture — rebuild the engine"
                )
        captured = dict(self.bound_pointers)
        for i, buf in self.inputs:
            if buf.data_ptr() != captured[i]:
                raise CaptureAddressError(
                    f"{where}: replay copies input {i} into {buf.data_ptr():#x} but the capture reads "
                    f"{captured[i]:#x}, so the piece would run on stale data; static input buffers must not be "
                    "replaced after capture — rebuild the captures (set the piece's mode again)"
                )


class CaptureAddressError(KilnError):
    """A replay would read memory other than what its capture recorded (trace mode check)."""


class CpuCapture(Capture):
    def __init__(self, fn: PieceFn, args: Sequence[Any], dynamic_args: Sequence[int], adopt: set[int]) -> None:
        super().__init__(fn, args, dynamic_args, adopt)
        outs = fn(*self.args)  # warm-up: first-call allocations and kernel loading happen here
        self.outputs = [o.clone() for o in outs]
        self.latency_s = _time_cpu(self.replay)

    def replay(self) -> None:
        for buf, out in zip(self.outputs, self.fn(*self.args), strict=True):
            buf.copy_(out)


class CudaGraphCapture(Capture):
    def __init__(
        self, fn: PieceFn, args: Sequence[Any], dynamic_args: Sequence[int], adopt: set[int], pool: Any
    ) -> None:
        super().__init__(fn, args, dynamic_args, adopt)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (lazy init, workspace allocation)
                fn(*self.args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with live_collectives(), torch.cuda.graph(self.graph, pool=pool):  # records a multi-device step's NCCL calls
            outs = fn(*self.args)
        self.outputs = list(outs)
        self.latency_s = _time_cuda(self.replay)

    def replay(self) -> None:
        self.graph.replay()


def make_capture(
    device: torch.device, fn: PieceFn, args: Sequence[Any], dynamic_args: Sequence[int], adopt: set[int], pool: Any
) -> Capture:
    """A recorded graph where the platform records graphs (CUDA), else the specialised call (CPU)."""
    if platform_of(device).records_graphs:
        return CudaGraphCapture(fn, args, dynamic_args=dynamic_args, adopt=adopt, pool=pool)
    return CpuCapture(fn, args, dynamic_args=dynamic_args, adopt=adopt)


def _time_cpu(fn: Callable[[], None], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _time_cuda(fn: Callable[[], None], repeats: int = 3) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best
