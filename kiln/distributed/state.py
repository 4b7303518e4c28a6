"""This process's place in a multi-device run: its ranks and process groups (torch.distributed), set once per process.

Ranks are laid out stage-major: rank = pipeline_stage * tensor_size + tensor_rank, so one pipeline stage's tensor
group is consecutive ranks (on one node, consecutive devices). Two kinds of group:
- the tensor group (gloo on CPU, NCCL on CUDA) carries the all-reduces and all-gathers of the forward;
- the control group (always gloo, every rank, no timeout) carries the step's inputs from rank 0 and the start-up
  agreements (KV blocks), host-side objects that should not round-trip through a GPU.

A process that never calls `init_distributed` is the whole model: `tensor_parallel()` is size 1 and nothing here
touches torch.distributed.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, replace

import torch.distributed as dist

from kiln.config import ParallelConfig
from kiln.distributed.sharding import SINGLE, WHOLE, PipelineStage, TensorParallel, even_stage_layers
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")

# how long a collective may wait for a peer before it fails: a dead or stuck rank becomes an error, never a hang
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class RankState:
    rank: int
    world_size: int
    tp: TensorParallel
    stage: int
    num_stages: int
    tp_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    device: str
    stage_layers: tuple[tuple[int, ...], ...] | None = None  # a recipe's placement; None: an even split
    # every rank runs the same program (the debugger, kiln.distributed.spmd), each with its own scheduler, instead of
    # rank 0's steps: every rank then gets the step's logits and samples the same tokens
    spmd: bool = False

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler, sampling and the server; the others follow its steps."""
        return self.rank == 0

    def stage_rank(self, stage: int) -> int:
        """The rank holding the same tensor slice in pipeline stage `stage` (its send/recv peer)."""
        return stage * self.tp.size + self.tp.rank


_STATE: RankState | None = None


def _collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


def hold_rendezvous(addr: str, port: int = 0) -> dist.TCPStore:
    """The rendezvous store served by rank 0 on `port` (0: one the system picks), held from now on: a port checked
    or picked, released and bound again later could be taken in between."""
    return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=_collective_timeout())


def join_rendezvous(addr: str, port: int) -> dist.TCPStore:
    """A started rank's client of rank 0's held rendezvous store (`hold_rendezvous`)."""
    return dist.TCPStore(addr, port, is_master=False, timeout=_collective_timeout())


def init_distributed(
    parallel: ParallelConfig, rank: int, device: str, port: int, store: dist.Store | None = None
) -> RankState:
    """Join the process group of `parallel.world_size` ranks as `rank`, and make the groups: through `store` (node
    0's held rendezvous store, or a client of it: `hold_rendezvous`, `join_rendezvous`), else at master_addr:port
    as a launcher such as torchrun expects."""
    global _STATE
    platform = platform_of(device)
    backend = platform.collective_backend
    rank_device = platform.bind_rank(rank)
    where = {"store": store} if store is not None else {"init_method": f"tcp://{parallel.master_addr}:{port}"}
    dist.init_process_group(backend, rank=rank, world_size=parallel.world_size, timeout=_collective_timeout(), **where)
    # NOTE: the other ranks wait on the control group while rank 0 has no requests, for as long as the server is
    # idle: no timeout there (a dead peer still fails it at once: its sockets close)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    stage, tp_rank = divmod(rank, parallel.tensor)
    tp_group = None
    for s in range(parallel.pipeline):  # NOTE: every rank creates every group, in the same order (torch requires it)
        group = dist.new_group(list(range(s * parallel.tensor, (s + 1) * parallel.tensor)), backend=backend)
        if s == stage:
            tp_group = group
    assert tp_group is not None
    platform.warm_collectives(tp_group)
    _STATE = RankState(
        rank=rank,
        world_size=parallel.world_size,
        tp=TensorParallel(tp_rank, parallel.tensor),
        stage=stage,
        num_stages=parallel.pipeline,
        tp_group=tp_group,
        control_group=control,
        device=str(rank_device),
        stage_layers=parallel.stage_layers,
    )
    logger.info(
        "Rank %d of %d (pid %d): tensor rank %d of %d, pipeline stage %d of %d (%s)",
        rank,
        parallel.world_size,
        os.getpid(),
        tp_rank,
        parallel.tensor,
        stage,
        parallel.pipeline,
        backend,
    )
    return _STATE


def shutdown_distributed() -> None:
    """Leave the process group (a process may then run single-device engines again)."""
    global _STATE
    if _STATE is not None and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = None


def run_as_spmd() -> RankState:
    """Mark this rank as one of a program every rank runs (`RankState.spmd`)."""
    global _STATE
    assert _STATE is not None
    _STATE = replace(_STATE, spmd=True)
    return _STATE


def rank_state() -> RankState | None:
    """This process's ranks and groups; None when it runs the whole model alone."""
    return _STATE


def tensor_parallel() -> TensorParallel:
    return _STATE.tp if _STATE is not None else SINGLE


def pipeline_stage(num_layers: int) -> PipelineStage:
    """This process's pipeline stage for a model of `num_layers` decoder layers (the whole model when alone)."""
    s = _STATE
    if s is None or s.num_stages == 1:
        return WHOLE
    layers = (s.stage_layers or even_stage_layers(num_layers, s.num_stages))[s.stage]
    prev_rank = s.stage_rank(s.stage - 1) if s.stage > 0 else None
    next_rank = s.stage_rank(s.stage + 1) if s.stage < s.num_stages - 1 else None
    return PipelineStage(
        stage=s.stage, num_stages=s.num_stages, layers=tuple(layers), prev_rank=prev_rank, next_rank=next_rank
    )
