"""Steps in flight on a pipeline: rank 0 launches the next step while the later stages still run the last one.

With S pipeline stages and one step at a time, each stage idles while the others work. vLLM keeps S batches of
disjoint sequences in flight (its virtual engines); kiln does the same from rank 0's engine loop:
- each step takes at most 1/S of the active requests, never one whose step is still in flight (the scheduler skips
  them, and never preempts them: their blocks are being written);
- `launch` sends the plan (point to point, without waiting: kiln.distributed.control.StepChannel) and runs stage 0's
  forward, which hands its hidden states on; the logits are received when the step completes;
- a step completes once S are in flight, or when nothing else can be launched: its tokens are sampled and the
  scheduler updated, which frees its requests for the next launch.

Every stage runs the steps in launch order, so a block freed by an abort while its step is in flight is written by
that step before any later one reuses it; the aborted request's output is dropped (`EngineCore.update`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kiln.engine.model_runner import Launched
from kiln.engine.scheduler_output import SchedulerOutput
from kiln.errors import WorkerFailure
from kiln.recipe.guards import RecipeViolation

if TYPE_CHECKING:
    from kiln.engine.core import EngineCore
    from kiln.engine.request import RequestOutput


class StepPipeline:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.launched: deque[Launched] = deque()
        self.most_in_flight = 0  # the most steps launched and not yet completed at once

    def step(self, core: EngineCore) -> list[RequestOutput]:
        """Launch a step of requests not in flight (if any), then complete the oldest step when `depth` are in
        flight or nothing new was launched."""
        scheduler = core.scheduler
        sched = scheduler.schedule() if len(self.launched) < self.depth else SchedulerOutput()
        try:
            if not sched.is_empty:
                self.launched.append(core.runner.launch(sched))
                self.most_in_flight = max(self.most_in_flight, len(self.launched))
                scheduler.in_flight.update(s.request.request_id for s in sched.scheduled)
            if not self.launched or (len(self.launched) < self.depth and not sched.is_empty):
                return []
            done = self.launched.popleft()
            scheduler.in_flight.difference_update(s.request.request_id for s in done.sched.scheduled)
            core.num_steps += 1
            return core.update(done.sched, core.runner.complete(done))
        except RecipeViolation as exc:  # the plan broke the recipe before anything was sent: its requests fail
            return [out for s in sched.scheduled if (out := core.fail(s.request.request_id, str(exc)))]
        except Exception as exc:
            assert core.workers is not None  # a pipeline is always a multi-device engine
            raise WorkerFailure(core.workers.blame(exc)) from exc
