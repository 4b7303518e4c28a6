"""Starting the ranks of a multi-device engine, following rank 0's steps, and noticing a rank that dies.

One node: the process that runs `kiln serve` (or `LLM`, `kiln generate`) is rank 0; it starts the other ranks with
torch.multiprocessing (spawn) before it loads its own shard. Several nodes: each node's `kiln serve --nnodes N
--node-rank K --master-addr A --master-port P` starts its share of the ranks the same way, and torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are honoured when a launcher started every rank itself. Every rank
builds the same engine on its shard; rank 0 schedules, samples and serves, and the others run each step it
broadcasts (`follow`) until it says stop.

A rank that dies is reported with its rank and last error (each worker sends its error up before exiting); rank 0
then fails its engine (`WorkerFailure`), so a server answers 503 and exits non-zero instead of hanging.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.config import EngineConfig
from kiln.distributed.control import StepChannel
from kiln.distributed.state import (
    RankState,
    hold_rendezvous,
    init_distributed,
    join_rendezvous,
    shutdown_distributed,
)
from kiln.errors import ConfigError, WorkerFailure
from kiln.log import setup_logging
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")

STOP_SEND_TIMEOUT = timedelta(seconds=10)  # the stop reaching every rank; a dead one is then ended by signal


@dataclass(frozen=True)
class Placement:
    """Which ranks this node runs: [first, first + count); `port` is the rendezvous port."""

    first: int
    count: int
    port: int
    # node 0's rendezvous store, held from the moment the port is checked, so no other process can take it before
    # the ranks meet; every other rank joins it as a client (`join_rendezvous`)
    store: dist.TCPStore | None = None
    # started by a launcher such as torchrun: each rank meets the others at tcp://MASTER_ADDR:MASTER_PORT itself
    launched: bool = False


def placement(config: EngineConfig) -> Placement:
    """This node's ranks from the parallel flags, or from torchrun's variables when they are set."""
    p = config.parallel
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and "RANK" in os.environ:  # started by torchrun (or another launcher): one rank each
        if int(env_world) != p.world_size:
            raise ConfigError(
                f"WORLD_SIZE={env_world} from the launcher, but --tensor-parallel-size {p.tensor} x "
                f"--pipeline-parallel-size {p.pipeline} needs {p.world_size} ranks; start {p.world_size} processes"
            )
        port = int(os.environ.get("MASTER_PORT", p.master_port or 29500))
        return Placement(int(os.environ["RANK"]), 1, port, launched=True)
    if p.world_size % p.nnodes:
        raise ConfigError(f"{p.world_size} ranks do not split evenly over --nnodes {p.nnodes}")
    if not 0 <= p.node_rank < p.nnodes:
        raise ConfigError(f"--node-rank {p.node_rank}: expected 0 to {p.nnodes - 1} for --nnodes {p.nnodes}")
    platform = platform_of(config.device)
    if platform.separate_memory and p.world_size // p.nnodes > platform.device_count():
        raise ConfigError(
            f"{p.world_size // p.nnodes} ranks per node need as many devices; torch sees {platform.device_count()} "
            f"{platform.name} devices"
        )
    per_node = p.world_size // p.nnodes
    if p.node_rank > 0:  # node 0 holds the rendezvous; this node's ranks meet there
        return Placement(p.node_rank * per_node, per_node, p.master_port or 29500)
    store = _hold_rendezvous_port(config)
    return Placement(0, per_node, store.port, store)


def _hold_rendezvous_port(config: EngineConfig) -> dist.TCPStore:
    """Node 0's rendezvous store, bound at once: on --master-port (29500 when 0 on several nodes), or on a port the
    system picks when every rank runs here and the port was left at 0."""
    p = config.parallel
    port = 0 if p.master_port == 0 and p.nnodes == 1 else p.master_port or 29500
    try:
        return hold_rendezvous(p.master_addr, port)
    except dist.DistNetworkError as exc:
        reason = "Address already in use" if "EADDRINUSE" in str(exc) else str(exc).splitlines()[0]
        where = f"--master-port {port} on {p.master_addr}"
        raise ConfigError(f"{where} is in use ({reason}): pick a free port, or 0") from None


class Workers:
    """The ranks this process started, watched for an unexpected exit."""

    def __init__(self, procs: dict[int, mp.Process], errors: dict[int, Connection]) -> None:
        self.procs = procs
        self.errors = errors
        self.channel: StepChannel | None = None  # once this rank has joined the process group
        self.failure: str | None = None
        self.threads_before = torch.get_num_threads()
        self._stopping = False
        self._listeners: list[Callable[[], None]] = []
        threading.Thread(target=self._watch, name="kiln-workers", daemon=True).start()

    def on_failure(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        if not sentinels:
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        rank = sentinels[ready[0]]
        self.procs[rank].join(timeout=1.0)  # reaps it: its exit code is known
        self.failure = f"rank {rank} exited with code {self.procs[rank].exitcode}: {self._last_error(rank)}"
        logger.error("Worker %s; the engine stops", self.failure)
        for listener in self._listeners:
            listener()

    def _last_error(self, rank: int) -> str:
        pipe = self.errors[rank]
        try:
            if pipe.poll(1.0):
                return pipe.recv()
        except (EOFError, OSError):
            pass
        return "no error reported (killed by a signal?)"

    def blame(self, exc: BaseException) -> str:
        """Why a step failed on rank 0: a collective fails when a peer dies, so give the watcher a moment to name
        the rank that died; otherwise rank 0's own error."""
        deadline = time.monotonic() + 3.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.failure = self.failure or f"rank 0 failed: {type(exc).__name__}: {exc}"
        return self.failure

    def check(self) -> None:
        """Raise WorkerFailure if a rank has died."""
        if self.failure is not None:
            raise WorkerFailure(self.failure)

    def abort(self) -> None:
        """This rank failed: end the ranks it started at once (they may be inside a collective) and leave."""
        self._stopping = True
        _terminate(self.procs)
        self.stop()

    def stop(self) -> None:
        """Tell the other ranks to stop, wait for them, and leave the process group."""
        self._stopping = True
        driver = self.channel is not None and self.channel.state.is_driver
        if self.failure is None and driver and all(p.is_alive() for p in self.procs.values()):
            try:
                self.channel.send(None)  # type: ignore[union-attr]
                self.channel.drain(STOP_SEND_TIMEOUT)  # type: ignore[union-attr]
            except RuntimeError as exc:
                logger.warning("could not tell the workers to stop: %s", exc)
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        for pipe in self.errors.values():
            pipe.close()
        shutdown_distributed()
        torch.set_num_threads(self.threads_before)  # this process may run a single-device engine next


def start_ranks(config: EngineConfig, build: Callable[[EngineConfig], Any]) -> tuple[RankState, Workers]:
    """Start this node's other ranks, each building its engine with `build` (kiln.engine.setup.build.build_engine, a
    module-level function spawn can pickle), and join the process group as this node's first rank."""
    where = placement(config)
    ctx = mp.get_context("spawn")
    errors: dict[int, Connection] = {}
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // where.count)
    config = replace(config, num_threads=threads)
    procs = {}
    # NOTE: rank 0's progress bars stand for every rank's; a spawned rank inherits the environment at start, and
    # tqdm reads it when first imported
    os.environ["TQDM_DISABLE"], quiet = "1", os.environ.get("TQDM_DISABLE")
    try:
        for rank in range(where.first + 1, where.first + where.count):
            errors[rank], report = ctx.Pipe(duplex=False)
            args = (config, build, rank, where.port, report)
            procs[rank] = ctx.Process(target=_worker_main, args=args, name=f"kiln-rank{rank}")
            procs[rank].start()
    finally:
        if quiet is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = quiet
    atexit.register(_terminate, procs)  # runs before multiprocessing's own exit hook, which would join them
    workers = Workers(procs, errors)  # watched from now on: a rank that fails to start is named
    workers.threads_before = torch.get_num_threads()  # restored when the ranks stop
    torch.set_num_threads(threads)
    try:
        store = where.store
        if store is None and not where.launched:  # a later node's first rank: a client of node 0's store
            store = join_rendezvous(config.parallel.master_addr, where.port)
        state = init_distributed(
            parallel=config.parallel, rank=where.first, device=config.device, port=where.port, store=store
        )
    except Exception as exc:  # the rendezvous timed out or a rank died on the way
        reason = workers.blame(exc)
        workers.abort()
        raise WorkerFailure(f"the ranks could not start: {reason}") from None
    workers.channel = StepChannel(state)
    return state, workers


def _terminate(procs: dict[int, mp.Process]) -> None:
    for p in procs.values():
        if p.is_alive():
            p.terminate()


def _worker_main(
    config: EngineConfig,
    build: Callable[[EngineConfig], Any],
    rank: int,
    port: int,
    report: Connection,
) -> None:
    setup_logging(prefix=f"(rank {rank}) ")
    torch.set_num_threads(config.num_threads or 1)
    _exit_with_parent()
    try:
        store = join_rendezvous(config.parallel.master_addr, port)
        state = init_distributed(parallel=config.parallel, rank=rank, device=config.device, port=port, store=store)
        engine = build(config)
        if engine is not None:  # None: `build` ran a program of its own on this rank (kiln.distributed.spmd)
            follow(engine, StepChannel(state))
    except BaseException as exc:
        report.send(f"{type(exc).__name__}: {exc}")
        logger.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        raise SystemExit(1) from None
    finally:
        shutdown_distributed()


def _exit_with_parent() -> None:
    """A rank whose starter died (killed rank 0) must not linger holding memory: it exits too."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kiln-parent", daemon=True).start()


def follow(engine: Any, channel: StepChannel) -> int:
    """Run every step rank 0 broadcasts on `engine` (an EngineCore) until it sends None; returns the steps run."""
    runner = engine.runner
    steps = 0
    with torch.inference_mode():
        while (plan := channel.recv()) is not None:
            runner.run(plan)
            steps += 1
    return steps
