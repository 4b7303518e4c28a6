"""`RankRole`: what this rank does in each step of a multi-device engine, fixed when the engine is built and handed
to the runner, the scheduler and the core's constructors (nothing is written onto them afterwards).

Computed by `rank_role` from the rank's place (kiln.distributed.state.RankState) and the parallel config: its logits
head (kiln.distributed.control), the parts each step is split into on a pipeline, whether the last stage runs each
part's head right after its forward, and, on rank 0 of a pipeline, how many steps of disjoint sequences it keeps
in flight (kiln.engine.loop.pipelined). A single-device engine has `RankRole()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.config import ParallelConfig
from kiln.distributed.control import distributed_head
from kiln.distributed.state import RankState

if TYPE_CHECKING:
    from kiln.distributed.workers import Workers

Head = Callable[[torch.Tensor, list[int]], "torch.Tensor | None"]


@dataclass(frozen=True)
class RankRole:
    head: Head | None = None  # the sampled rows' logits across ranks and stages; None: the executor's own head
    micro_batches: int = 1  # a pipeline stage splits each step into this many parts (kiln.engine.running.step_plan)
    head_each_part: bool = False  # the last stage runs each part's head right after its forward
    steps_in_flight: int = 1  # > 1: rank 0 of a pipeline keeps this many steps launched; their heads are deferred
    workers: Workers | None = None  # rank 0: the other ranks, sent each step's plan

    @property
    def defers_heads(self) -> bool:
        return self.steps_in_flight > 1


SINGLE_DEVICE = RankRole()


def rank_role(
    state: RankState,
    parallel: ParallelConfig,
    model: nn.Module,
    compute_logits: Head,
    vocab_size: int,
    workers: Workers | None = None,
) -> RankRole:
    """This rank's role; `workers`: the ranks rank 0 started (pipeline steps stay one at a time when every rank
    runs its own program, as the debugger's do: their heads would not pair up)."""
    last_stage = getattr(model, "stage", None) is None or model.stage.is_last
    pipelined = state.num_stages > 1 and not state.spmd
    depth = (parallel.steps_in_flight or state.num_stages) if pipelined else 1
    return RankRole(
        head=distributed_head(state, compute_logits, vocab_size, last_stage),
        micro_batches=(parallel.micro_batches or (1 if depth > 1 else state.num_stages)) if pipelined else 1,
        head_each_part=last_stage,
        steps_in_flight=depth if state.is_driver else 1,
        workers=workers if state.is_driver else None,
    )
