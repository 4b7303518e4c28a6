"""`kiln debug diff` and `kiln debug bisect` on a multi-device engine: every rank debugs its own shard.

A rank's pieces are the model's graphs over its slice of the weights (tensor parallel) or its layers (pipeline),
with the collectives inside them. So each rank runs the whole command (kiln.distributed.spmd): its eager
reference, its graph paths and its taps, comparing boundaries it computes itself. Rank 0 prints every rank's
report under a header naming the rank's slice and stage; the exit code is the worst of them. Debug cases
(`--case`, `save-case`, `check-case`) and `--check` commands stay single-device: a case holds one model's tensors.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from kiln.compile.modes import PieceMode
from kiln.config import ParallelConfig
from kiln.debug.diff import Reference, run_diff
from kiln.debug.session import DebugSession, debug_engine_args, is_factory_spec
from kiln.debug.taps import LOGITS
from kiln.distributed.control import agree_min
from kiln.distributed.spmd import on_every_rank
from kiln.distributed.state import rank_state
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError
from kiln.log import setup_logging
from kiln.model.loader import open_checkpoint
from kiln.model.parallel import check_parallel


class RankReport(NamedTuple):
    """What one rank's debug command prints and returns."""

    code: int  # its exit code
    text: str  # its report
    first: str | None = None  # the first boundary that diverged (diff), if any


Report = Callable[[argparse.Namespace], RankReport]


def is_first_rank() -> bool:
    """Whether this process prints for the command: rank 0, or the only process."""
    state = rank_state()
    return state is None or state.is_driver


def report_per_rank(args: argparse.Namespace, given: EngineArgs, report: Report) -> int:
    """Run `report` here (one device) or on every rank (a module-level function: the ranks are spawned), print the
    report(s); returns the exit code."""
    config = resolve_engine_config(debug_engine_args(given), refuse_inert_options=False)
    parallel = config.parallel
    if not parallel.is_distributed:
        code, text, _ = report(args)
        print(text)
        return code
    if getattr(args, "case", None) or getattr(args, "check", None):
        raise ConfigError(
            "--case and --check are single-device (a debug case holds one model's tensors): drop them, or debug "
            "with --tensor-parallel-size 1 --pipeline-parallel-size 1"
        )
    if parallel.nnodes > 1:
        raise ConfigError("kiln debug starts every rank on this machine: drop --nnodes (it debugs one node's ranks)")
    if is_factory_spec(config.model):
        raise ConfigError("a multi-device debug session needs a checkpoint model (each rank loads its shard of it)")
    setup_logging()
    check_parallel(open_checkpoint(config.model).config, parallel)  # before any rank starts
    results = on_every_rank(config, partial(report, args))
    if getattr(args, "json", False):
        ranks = [{"rank": r, **_where(r, parallel), "report": json.loads(out.text)} for r, out in enumerate(results)]
        print(json.dumps(ranks, indent=1))
    else:
        for rank, out in enumerate(results):
            where = _where(rank, parallel)
            print(
                f"== rank {rank}: tensor slice {where['tensor_rank']} of {parallel.tensor}, pipeline stage "
                f"{where['stage']} of {parallel.pipeline} =="
            )
            print(out.text)
        if line := _first_across(results, parallel):
            print(line)
    return max(out.code for out in results)


def _first_across(results: list[RankReport], parallel: ParallelConfig) -> str | None:
    """Which rank's own boundary diverges first: the earliest stage (ranks go by stage) whose first divergence is
    not the logits, which every rank is given and which follow the last stage's layers."""
    found = [(rank, out.first) for rank, out in enumerate(results) if out.first is not None]
    own = [(rank, first) for rank, first in found if first != LOGITS] or found
    if not own:
        return None
    rank, first = own[0]
    return f"First divergence across ranks: {first} on rank {rank} (pipeline stage {_where(rank, parallel)['stage']})"


def check_same_pieces(count: int) -> None:
    """ConfigError on every rank unless every rank's graph has `count` pieces (bisection names pieces by index)."""
    if rank_state() is None:
        return
    low, high = agree_min(count), -agree_min(-count)
    if low != high:
        raise ConfigError(
            f"the pipeline stages have {low} to {high} graph pieces, but bisect needs the same count on every "
            "rank: run kiln debug diff, which names the rank whose boundary diverges first"
        )


def stage_culprits(session: DebugSession, culprits: list[int], reference: Reference | None) -> list[int]:
    """The culprit indices that name a faulty piece on this rank. On a pipeline an index names a piece on every
    stage: each culprit is captured alone (every other piece eager), and a stage keeps it when one of its own
    boundaries then diverges (not only the logits, which come from the last stage)."""
    state = rank_state()
    if state is None or state.num_stages == 1 or reference is None:
        return culprits
    kept = []
    for idx in culprits:
        modes = {p.index: PieceMode.EAGER for p in session.graph.pieces} | {idx: PieceMode.CAPTURED}
        first = run_diff(session, reference, test_mode="captured", ref_mode="eager", piece_modes=modes).first_divergence
        if first is not None and first.name != LOGITS:
            kept.append(idx)
    return kept


def _where(rank: int, parallel: ParallelConfig) -> dict[str, int]:
    stage, tensor_rank = divmod(rank, parallel.tensor)
    return {"tensor_rank": tensor_rank, "stage": stage}
