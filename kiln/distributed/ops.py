"""The forward's collectives as custom ops (`kiln::all_reduce`, `kiln::all_gather`, and a pipeline stage's
`kiln::send_next` / `kiln::recv_prev`), so dynamo keeps them as single nodes inside the compiled pieces and the full
decode graph (as vLLM registers its own), and the payload each moves.

While an executor prepares (`local_collectives()`: compiling, checking cached pieces against their traces, timing
kernels, CPU captures) the ops compute locally and move nothing: those runs depend on each rank's own cache and
timings, so ranks would not pair their collectives up. Only real steps (and a CUDA graph's capture itself, which
records the communication kernels: `live_collectives()`) communicate.

`COMM` counts what this process's collectives carry (payload bytes, not wire bytes: a ring all-reduce of B bytes
sends 2(N-1)/N * B per rank), so a step's communication volume can be read and checked against the model's shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist

from kiln.distributed.state import rank_state


class CommStats:
    """Calls and payload bytes per collective kind since the last `reset`."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in sorted(self.calls)}


COMM = CommStats()
_local = [False]


@contextmanager
def _collectives(local: bool) -> Iterator[None]:
    before, _local[0] = _local[0], local
    try:
        yield
    finally:
        _local[0] = before


def local_collectives() -> AbstractContextManager[None]:
    """The ops move nothing inside (module docstring)."""
    return _collectives(True)


def live_collectives() -> AbstractContextManager[None]:
    """The ops communicate inside, even within `local_collectives` (a CUDA graph capture records them)."""
    return _collectives(False)


def _live() -> bool:
    return rank_state() is not None and not _local[0]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel group (a row-parallel layer's partial products)."""
    state = rank_state()
    out = x.contiguous().clone()
    if state is not None and _live():
        dist.all_reduce(out, group=state.tp_group)
        COMM.add("all_reduce", _nbytes(out))
    return out


@all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _group_size() -> int:
    state = rank_state()
    return state.tp.size if state is not None else 1


@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (the vocab-parallel head's logits)."""
    state = rank_state()
    if state is None:
        return x.clone()
    if not _live():
        return torch.cat([x] * state.tp.size, dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp.size)]
    dist.all_gather(parts, x, group=state.tp_group)
    COMM.add("all_gather", _nbytes(x))
    return torch.cat(parts, dim)


@all_gather.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= _group_size()
    return x.new_empty(shape)


@torch.library.custom_op("kiln::send_next", mutates_args=())
def send_next(hidden: torch.Tensor, dst: int) -> torch.Tensor:
    """Hand this stage's hidden states to the next pipeline stage (rank `dst`); returns a copy, so the graph has
    an output that depends on the send."""
    hidden = hidden.contiguous()
    if _live():
        dist.send(hidden, dst)
        COMM.add("send", _nbytes(hidden))
    return hidden.clone()


@send_next.register_fake
def _(hidden: torch.Tensor, dst: int) -> torch.Tensor:
    return torch.empty_like(hidden)


@torch.library.custom_op("kiln::recv_prev", mutates_args=())
def recv_prev(input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype, src: int) -> torch.Tensor:
    """The previous pipeline stage's hidden states for this step's tokens (`input_ids` gives their number)."""
    hidden = torch.zeros(input_ids.shape[0], hidden_size, dtype=dtype, device=input_ids.device)
    if _live():
        dist.recv(hidden, src)
        COMM.add("recv", _nbytes(hidden))
    return hidden


@recv_prev.register_fake
def _(input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype, src: int) -> torch.Tensor:
    return input_ids.new_empty(input_ids.shape[0], hidden_size, dtype=dtype)
