"""`StepParts`: what a step loop runs, handed over when the engine is built; and the first verb of a step, proposing
draft tokens, which runs before the scheduler and hands it plain data (kiln.engine.speculation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.engine.output.updater import Updater
from kiln.engine.request import RequestOutput
from kiln.engine.running.model_runner import ModelRunner
from kiln.engine.scheduling.scheduler import Scheduler
from kiln.engine.scheduling.scheduler_output import SchedulerOutput
from kiln.engine.speculation.speculation import Proposals, Speculator

if TYPE_CHECKING:
    from kiln.distributed.workers import Workers


@dataclass(frozen=True)
class StepParts:
    scheduler: Scheduler
    runner: ModelRunner
    updater: Updater
    speculator: Speculator | None  # speculative decoding's proposer (None: off)
    workers: Workers | None  # the other ranks, when this is rank 0 of a multi-device engine

    def propose(self) -> Proposals:
        """The draft tokens this step's decoding sequences bring (the proposer's choice; none without one)."""
        if self.speculator is None:
            return Proposals()
        return self.speculator.propose(self.scheduler.decoding())

    def fail_all(self, sched: SchedulerOutput, message: str) -> list[RequestOutput]:
        """Every request of `sched` failed with `message` (a step the recipe refused)."""
        return [out for s in sched.scheduled if (out := self.updater.fail(s.request.request_id, message))]
