"""The forward's collectives as custom ops (`kiln::all_reduce`, `kiln::all_gather`), so dynamo keeps them as single
nodes inside the compiled pieces and the full decode graph (as vLLM registers its own), and the payload each moves.

`COMM` counts what this process's collectives carry (payload bytes, not wire bytes: a ring all-reduce of B bytes
sends 2(N-1)/N * B per rank), so a step's communication volume can be read and checked against the model's shape.
"""

from __future__ import annotations

from collections import Counter

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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel group (a row-parallel layer's partial products)."""
    state = rank_state()
    out = x.contiguous().clone()
    if state is not None:
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
