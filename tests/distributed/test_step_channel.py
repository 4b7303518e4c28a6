"""The step channel's stop reaches a rank that is still busy when rank 0 leaves the process group and exits: rank 0
drains its sends before it goes (a send still queued when its process exits is lost, and a rank on another node then
waits for it forever; the two-node test's flake under load)."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.distributed.control import StepChannel
from kiln.distributed.state import hold_rendezvous, join_rendezvous
from kiln.distributed.workers import STOP_SEND_TIMEOUT
from tests.server.live import free_port

BUSY_S = 1.0  # the follower is still running its step when rank 0 sends the stop and leaves
PLAN = {"step": 1, "input_ids": list(range(100_000))}  # a long prefill's plan: more than a socket buffer holds


def _channel() -> StepChannel:
    return StepChannel(SimpleNamespace(world_size=2, control_group=None))  # type: ignore[arg-type]


def _leader(port: int) -> None:
    store = hold_rendezvous("127.0.0.1", port)
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    channel = _channel()
    channel.send(PLAN)
    channel.send(None)
    channel.drain(STOP_SEND_TIMEOUT)
    dist.destroy_process_group()
    os._exit(0)  # as a node's process ends: nothing left running in the background finishes a send


def _follower(port: int, report: Connection) -> None:
    store = join_rendezvous("127.0.0.1", port)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    channel = _channel()
    time.sleep(BUSY_S)
    try:
        report.send(("received", channel.recv(), channel.recv()))
    except RuntimeError as exc:  # rank 0 left with the stop unsent
        report.send(("lost", str(exc)))
    finally:
        dist.destroy_process_group()


def test_the_stop_reaches_a_busy_rank_after_rank_0_exits() -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    follower = ctx.Process(target=_follower, args=(port, theirs))
    leader = ctx.Process(target=_leader, args=(port,))
    leader.start()
    follower.start()
    try:
        assert mine.poll(60), "the follower said nothing"
        said = mine.recv()
        assert said[0] == "received", said
        assert said[1:] == (PLAN, None)
    finally:
        for p in (leader, follower):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
