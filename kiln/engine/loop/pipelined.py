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

from kiln.engine.loop.parts import StepParts
from kiln.engine.request import RequestOutput
from kiln.engine.running.model_runner import Launched
from kiln.engine.scheduling.scheduler_output import SchedulerOutput
from kiln.errors import WorkerFailure
from kiln.recipe.guards import RecipeViolation


class PipelinedSteps:
    def __init__(self, parts: StepParts, depth: int) -> None:
        assert parts.workers is not None, "a pipeline is always a multi-device engine"
        self.parts = parts
        self.depth = depth
        self.launched: deque[Launched] = deque()
        self.most_in_flight = 0  # the most steps launched and not yet completed at once
        self.num_steps = 0

    def step(self) -> list[RequestOutput]:
        """Launch a step of requests not in flight (if any), then complete the oldest step when `depth` are in
        flight or nothing new was launched."""
        parts, scheduler = self.parts, self.parts.scheduler
        if len(self.launched) < self.depth:
            proposals = parts.propose()
            sched = scheduler.schedule(proposals.tokens)
        else:
            proposals, sched = None, SchedulerOutput()
        try:
            if not sched.is_empty:
                self.launched.append(parts.runner.launch(sched, proposals.probs if proposals else None))
                self.most_in_flight = max(self.most_in_flight, len(self.launched))
                scheduler.launched(sched)
            if not self.launched or (len(self.launched) < self.depth and not sched.is_empty):
                return []
            done = self.launched.popleft()
            scheduler.completed(done.sched)
            self.num_steps += 1
            return parts.updater.update(done.sched, parts.runner.complete(done))
        except RecipeViolation as exc:  # the plan broke the recipe before anything was sent: its requests fail
            return parts.fail_all(sched, str(exc))
        except Exception as exc:
            assert parts.workers is not None
            raise WorkerFailure(parts.workers.blame(exc)) from exc
