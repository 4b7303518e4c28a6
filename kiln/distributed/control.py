"""Rank 0 to the other ranks, outside the forward: each step's plan, and start-up agreements (over the control
group, kiln.distributed.state). Every rank of a multi-device engine runs the steps rank 0 schedules, in the same
order, so their collectives pair up."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.distributed.ops import COMM
from kiln.distributed.state import RankState, rank_state


def agree_min(value: int) -> int:
    """The smallest of every rank's `value` (the KV blocks each can hold: ranks may hold different KV heads)."""
    state = rank_state()
    if state is None:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.control_group)
    return int(t.item())


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the whole vocabulary from each tensor-parallel rank's slice (padding columns dropped)."""
    return torch.ops.kiln.all_gather(logits, -1)[:, :vocab_size]


Head = Callable[[torch.Tensor, list[int]], "torch.Tensor | None"]


def distributed_head(state: RankState, compute: Head, vocab_size: int, last_stage: bool) -> Head:
    """The logits head of one rank: the last pipeline stage computes the sampled rows' logits (gathering the
    vocabulary slices of its tensor-parallel ranks) and, when rank 0 is elsewhere, its first tensor rank sends them
    there; rank 0 receives them; any other rank returns None."""
    source = state.stage_rank(state.num_stages - 1) - state.tp.rank  # the last stage's first tensor rank
    sending: list[dist.Work] = []
    if state.spmd:
        return _everywhere_head(
            state=state, compute=compute, vocab_size=vocab_size, last_stage=last_stage, source=source
        )

    def head(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        if last_stage:
            logits = compute(hidden, rows)
            if state.tp.is_split:
                logits = gather_vocab(logits, vocab_size)
            if state.rank == source and not state.is_driver:
                # NOTE: sent without waiting: rank 0 receives a step's logits only once it has sent every part of
                # the step (kiln.engine.running.step_plan), so a blocking send here would wait for it forever
                while sending:
                    sending.pop().wait()
                logits = logits.float().contiguous()
                sending.append(dist.isend(logits, 0))
                COMM.add("send", logits.numel() * 4)
            return logits
        if state.is_driver:
            logits = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=state.device)
            dist.recv(logits, source)
            COMM.add("recv", logits.numel() * 4)
            return logits
        return None

    return head


def _everywhere_head(state: RankState, compute: Head, vocab_size: int, last_stage: bool, source: int) -> Head:
    """The head when every rank runs the same program: every rank gets the logits (the last stage's tensor ranks
    from their all-gather, the others from the last stage's broadcast), so each samples the same tokens."""

    def head(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if last_stage:
            logits = compute(hidden, rows)
            logits = (gather_vocab(logits, vocab_size) if state.tp.is_split else logits).float().contiguous()
        else:
            logits = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=state.device)
        if state.num_stages > 1:
            dist.broadcast(logits, source)
            COMM.add("broadcast", logits.numel() * 4)
        return logits

    return head


class StepChannel:
    """Sends each step's plan (kiln.engine.running.model_runner.StepPlan) from rank 0 to every other rank, point to
    point and without waiting (a pickled byte tensor after its length), so rank 0 never waits for a busy stage to take
    it: on a pipeline it launches the next step while the last stage still runs the previous one. `None` says stop."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, plan: object | None) -> None:
        data = pickle.dumps(plan)
        COMM.add("plan", len(data))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        self._sending = [(work, t) for work, t in self._sending if not work.is_completed()]
        for rank in range(1, self.state.world_size):
            for t in (size, payload):
                self._sending.append((dist.isend(t, rank, group=self.state.control_group), t))

    def drain(self, timeout: timedelta) -> None:
        """Wait until every plan sent has left (the stop above all: a process that leaves the group with it still
        queued never sends it, and a rank on another node would wait for it forever)."""
        for work, _ in self._sending:
            work.wait(timeout)
        self._sending = []

    def recv(self) -> object | None:
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, 0, group=self.state.control_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, 0, group=self.state.control_group)
        return pickle.loads(payload.numpy().tobytes())
