"""One step at a time: propose, schedule, execute, update. A batched step that raises is run again one request at a
time (its KV writes repeat at the same slots, and nothing was updated yet), so only the requests that fail on their
own are failed; on a multi-device engine the ranks run each step together and none can retry it alone, so the
engine stops (kiln.errors.WorkerFailure, naming the rank)."""

from __future__ import annotations

import logging
import time

from kiln.engine.loop.parts import StepParts
from kiln.engine.request import RequestOutput
from kiln.engine.running.step_sample import DraftProbs
from kiln.engine.scheduling.scheduler_output import SchedulerOutput
from kiln.errors import INTERNAL_ERROR, WorkerFailure
from kiln.recipe.guards import RecipeViolation

logger = logging.getLogger("kiln")


class PlainSteps:
    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.num_steps = 0

    def step(self) -> list[RequestOutput]:
        parts = self.parts
        proposals = parts.propose()  # (a draft model's round: measured apart, kiln.engine.speculation.draft)
        sched = parts.scheduler.schedule(proposals.tokens)
        if sched.is_empty:
            return []
        cost = parts.scheduler.step_cost(sched)
        start = time.perf_counter()
        try:
            result = parts.runner.execute(sched, proposals.probs)
        except RecipeViolation as exc:  # the step's shape breaks the recipe: its requests fail, named by the line
            logger.error("step refused by the recipe: %s", exc)
            return parts.fail_all(sched, str(exc))
        except Exception as exc:
            if parts.workers is not None:
                # NOTE: the ranks run each step together; none can retry it alone, so the engine stops
                raise WorkerFailure(parts.workers.blame(exc)) from exc
            if len(sched.scheduled) == 1:
                raise
            return self._isolate_failure(sched, proposals.probs)
        self.num_steps += 1
        parts.scheduler.prefill.observe(cost, time.perf_counter() - start)
        outputs = parts.updater.update(sched, result)
        if parts.speculator is not None and (rows := sched.decode_rows):  # what verifying costs here, measured
            parts.speculator.costs.observe(rows, time.perf_counter() - start)
        return outputs

    def _isolate_failure(self, sched: SchedulerOutput, draft_probs: DraftProbs) -> list[RequestOutput]:
        """A batched step raised: run its requests one at a time, failing only those that fail on their own."""
        parts = self.parts
        ids = [s.request.request_id for s in sched.scheduled]
        logger.exception("engine step failed for requests %s; running them one by one to isolate the cause", ids)
        outputs = []
        for s in sched.scheduled:
            single = SchedulerOutput([s])
            try:
                result = parts.runner.execute(single, draft_probs)
            except Exception:
                logger.exception("request %s fails on its own: failing it", s.request.request_id)
                outputs.append(parts.updater.fail(s.request.request_id, INTERNAL_ERROR))
                continue
            outputs += parts.updater.update(single, result)
        self.num_steps += 1
        return outputs
