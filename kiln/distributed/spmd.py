"""One program on every rank: how the debugger runs a multi-device engine.

A serving engine is driven by rank 0 (kiln.distributed.workers: the other ranks run the plans it broadcasts). The
debugger cannot be: it builds several engines over one model, switches piece modes, taps pieces and reruns paths,
all on the rank's own shard. So each rank runs the whole debug command itself (`RankState.spmd`): its own engines
and schedulers, the same requests in the same order, so their collectives pair up. Every rank gets each step's
logits (kiln.distributed.control) and samples the same tokens; where the program branches on what it measured
(bisection), it branches on `agree_any`. Each rank's result comes back to rank 0, which reports them all.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist

from kiln.config import EngineConfig
from kiln.distributed.control import StepChannel
from kiln.distributed.state import RankState, rank_state, run_as_spmd
from kiln.distributed.workers import Workers, start_ranks

logger = logging.getLogger("kiln")

T = TypeVar("T")


def on_every_rank(config: EngineConfig, program: Callable[[], T]) -> list[T]:
    """Start `config`'s other ranks on this node, run `program` (picklable: a module-level function or a partial of
    one) on each of them and here; returns every rank's result on rank 0 (in rank order). A rank that dies ends
    this process with its error: the others may be waiting for it in a collective."""
    _, workers = start_ranks(config, partial(_rank_main, program))
    workers.on_failure(partial(_exit_on_failure, workers))
    try:
        results = _gather(run_as_spmd(), program())
    except BaseException:
        workers.abort()
        raise
    workers.stop()
    return results


def agree_any(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (a single-device run: `flag`)."""
    state = rank_state()
    if state is None:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.control_group)
    return bool(t.item())


def _rank_main(program: Callable[[], T], config: EngineConfig) -> None:
    """A started rank (kiln.distributed.workers): run the program, hand its result to rank 0, wait to be stopped."""
    state = run_as_spmd()
    _gather(state, program())
    StepChannel(state).recv()  # rank 0's stop
    return None


def _gather(state: RankState, result: T) -> list[T]:
    results: list[T | None] = [None] * state.world_size if state.is_driver else []
    dist.gather_object(result, results if state.is_driver else None, dst=0, group=state.control_group)
    return results  # type: ignore[return-value]


def _exit_on_failure(workers: Workers) -> None:
    print(f"kiln: error: {workers.failure}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)
