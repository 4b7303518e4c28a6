"""EngineCore: the step, schedule -> execute -> update, and the requests it serves.

It is handed a loaded model, its tokenizer and an executor (by `kiln.engine.build.build_engine`, or by the
debugger, which runs several executors over one model); it owns the KV block pool, the scheduler and the runner.
Admission (kiln.engine.admission) and the update of requests by a step's tokens (kiln.engine.updater, with the stop
rules of kiln.engine.outputs) live in modules of their own. Construction allocates; `prepare()` is the executor's
prepare phase (kernel plan, trace, compile, capture), called once by whoever builds the engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from torch import nn

from kiln.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, ModelConfig
from kiln.engine.admission import Admission
from kiln.engine.kv_cache import BlockPool
from kiln.engine.kv_plan import kv_budget, kv_cache_blocks, log_kv_cache
from kiln.engine.model_runner import ModelRunner, StepObserver
from kiln.engine.prefill_budget import attention_tokens_of
from kiln.engine.prefix_sharing import cache_namespace, prefix_keys_for
from kiln.engine.rank_role import SINGLE_DEVICE, RankRole
from kiln.engine.request import Request, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.scheduler_output import SchedulerOutput
from kiln.engine.speculation import Speculator
from kiln.engine.step_sample import ModelRunnerOutput
from kiln.engine.step_shape import StepShaper
from kiln.engine.structured_output import Grammars
from kiln.engine.updater import Updater
from kiln.errors import INTERNAL_ERROR, RequestError, WorkerFailure
from kiln.executor.base import Executor
from kiln.model.kv_format import kv_dtype_name, kv_storage_dtype
from kiln.model.tokenizer import KilnTokenizer
from kiln.recipe.guards import RecipeViolation

if TYPE_CHECKING:
    from kiln.distributed.workers import Workers

logger = logging.getLogger("kiln")


class StepLoop(Protocol):
    def step(self, core: EngineCore) -> list[RequestOutput]:
        """One step of `core` in its own way (kiln.engine.step_pipeline)."""


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        tokenizer: KilnTokenizer | None,
        executor: Executor,
        checkpoint_path: str = "",
        observer: StepObserver | None = None,
        role: RankRole = SINGLE_DEVICE,
        step_loop: StepLoop | None = None,
    ) -> None:
        """`role`: this rank's part in a multi-device engine (kiln.engine.rank_role); `step_loop`: how rank 0 of a
        pipeline keeping steps in flight runs a step (kiln.engine.step_pipeline). Both fixed here."""
        self.config = config
        self.recipe = config.recipe
        self.checkpoint_path = checkpoint_path
        self.model = model
        self.tokenizer = tokenizer
        mc: ModelConfig = model.config
        self.model_config = mc
        self.max_model_len = config.max_model_len or self.default_max_model_len(mc)
        eos = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        cc = config.cache
        dtype = next(model.parameters()).dtype
        kv_dtype = kv_storage_dtype(cc.dtype, dtype)  # kiln.model.kv_format: "auto" resolved for this model
        p = config.parallel
        budget, budget_reason = kv_budget(cc, next(model.parameters()).device, max(1, p.world_size // p.nnodes))
        blocks = kv_cache_blocks(cc, config.scheduler, model, kv_dtype, budget)  # (every layer's, a hybrid's sliding)
        self.pool = BlockPool(blocks[0], cc.block_size)
        self.window_pool = BlockPool(blocks[1], cc.block_size) if blocks[1] else None
        self.shaper = StepShaper.for_engine(config, executor.pad_to)
        self.runner = ModelRunner(
            model,
            executor,
            blocks[0],
            cc.block_size,
            kv_dtype,
            self.eos_token_ids,
            observer=observer,
            shaper=self.shaper,
            window_blocks=blocks[1],
            role=role,
            head_rows=config.sampled_rows,
            pooling=config.pooling,
        )
        window = mc.uniform_sliding_window or mc.hybrid_sliding_window
        # speculative decoding's proposer (kiln.engine.speculation): the scheduler asks it for drafts, the step times it
        self.speculator = Speculator.for_config(config.speculative, self.max_model_len)
        model_name, kv_name = checkpoint_path or config.model, kv_dtype_name(kv_dtype)
        namespace = cache_namespace(model_name, config.quantization, config.activations, kv_name)
        self.scheduler = Scheduler(
            config.scheduler,
            self.pool,
            self.shaper,
            window=window,
            window_pool=self.window_pool,
            steps_in_flight=role.steps_in_flight,
            prefix_keys=prefix_keys_for(cc, mc, namespace),
            speculator=self.speculator,
            attention_tokens=attention_tokens_of(mc),
        )
        log_kv_cache(cc, blocks, self.runner.kv_cache_bytes, kv_dtype, self.max_model_len, mc, budget_reason)
        self.updater = Updater(
            self.scheduler, tokenizer, self.eos_token_ids, self.max_model_len, pooling=config.pooling
        )
        self.workers: Workers | None = role.workers  # the other ranks, when this is rank 0 of a multi-device engine
        self.pipeline = step_loop
        self.grammars = (
            Grammars(tokenizer.tokenizer, mc.vocab_size, self.eos_token_ids, config.grammar_cache_bytes)
            if tokenizer
            else None
        )
        self.admission = Admission(
            tokenizer,
            mc.vocab_size,
            self.max_model_len,
            self.recipe,
            self.shaper,
            chunked_prefill=config.scheduler.enable_chunked_prefill,
            blocks_short=self.scheduler.blocks_short,
            seed=config.seed,
            grammars=self.grammars,
            multi_device=role.head is not None,
        )
        self.num_steps = 0

    def prepare(self) -> EngineCore:
        """The prepare phase, apart from construction: the executor's kernel plan and, in graph mode, its trace,
        compiles and captures over this engine's KV caches; then the recipe's shapes are checked against the
        executor's padding. Once, before the first step; returns the engine."""
        self.runner.prepare_executor()
        if self.recipe is not None and not self.shaper.fits(1, 1):
            self.shaper.check(1, 1, [])  # raises RecipeViolation naming the constraints that forbid every step
        return self

    @staticmethod
    def default_max_model_len(model_config: ModelConfig) -> int:
        return min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    @property
    def requests(self) -> dict[str, Request]:
        """The requests served now, by id (admitted and not yet finished)."""
        return self.updater.requests

    @property
    def executor(self) -> Executor:
        return self.runner.executor

    # -- requests ---------------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        forced_output: list[int] | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and validate; raises RequestError (naming the request) without touching engine state."""
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}", request_id)
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise RequestError(
                f"priority {priority} needs the priority scheduling policy; this engine schedules fcfs (start it "
                "with --scheduling-policy priority, or send priority 0)",
                request_id,
                "priority",
            )
        return self.admission.make_request(request_id, prompt, params, forced_output, priority)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        forced_output: list[int] | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue a request; `forced_output` teacher-forces its output tokens (see `Request.forced_output`);
        `priority` orders it under the priority scheduling policy (lower first)."""
        req = self.make_request(request_id, prompt, params, forced_output, priority)
        self.updater.track(req)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.updater.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def reset_prefix_cache(self, quiet: bool = False) -> int:
        """Drop every cached block no request holds (POST /reset_prefix_cache); returns how many, logged unless
        `quiet` (the bench, between its passes)."""
        if self.scheduler.prefix is None:
            return 0
        dropped = self.scheduler.prefix.reset()
        held = self.pool.num_cached_blocks
        log = logger.debug if quiet else logger.info
        log("Prefix cache cleared: %d cached blocks dropped (%d held by running requests stay)", dropped, held)
        return dropped

    # -- the step -----------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """WorkerFailure if another rank of this engine has died."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop the other ranks (a single-device engine holds nothing to release)."""
        if self.workers is not None:
            self.workers.stop()
            self.workers = None

    def step(self) -> list[RequestOutput]:
        if not self.runner.is_prepared:
            raise RuntimeError("EngineCore.prepare() must run before the first step (kiln.engine.build does it)")
        self.check_alive()
        if self.pipeline is not None:  # steps in flight on a pipeline
            return self.pipeline.step(self)
        sched = self.scheduler.schedule()  # (with a draft model, its round: measured apart, kiln.engine.draft)
        if sched.is_empty:
            return []
        cost = self.scheduler.step_cost(sched)
        start = time.perf_counter()
        try:
            result = self.runner.execute(sched)
        except RecipeViolation as exc:  # the step's shape breaks the recipe: its requests fail, named by the line
            logger.error("step refused by the recipe: %s", exc)
            return [out for s in sched.scheduled if (out := self.fail(s.request.request_id, str(exc)))]
        except Exception as exc:
            if self.workers is not None:
                # NOTE: the ranks run each step together; none can retry it alone, so the engine stops
                raise WorkerFailure(self.workers.blame(exc)) from exc
            if len(sched.scheduled) == 1:
                raise
            return self._isolate_failure(sched)
        self.num_steps += 1
        self.scheduler.prefill.observe(cost, time.perf_counter() - start)
        outputs = self.update(sched, result)
        if self.speculator is not None and (rows := sched.decode_rows):  # what verifying costs here, measured
            self.speculator.costs.observe(rows, time.perf_counter() - start)
        return outputs

    def _isolate_failure(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """A batched step raised: run its requests one at a time (their KV writes repeat at the same slots, and
        nothing was updated yet), so only the requests that fail on their own are failed."""
        ids = [s.request.request_id for s in sched.scheduled]
        logger.exception("engine step failed for requests %s; running them one by one to isolate the cause", ids)
        outputs = []
        for s in sched.scheduled:
            single = SchedulerOutput([s])
            try:
                result = self.runner.execute(single)
            except Exception:
                logger.exception("request %s fails on its own: failing it", s.request.request_id)
                outputs.append(self.fail(s.request.request_id, INTERNAL_ERROR))
                continue
            outputs += self.update(single, result)
        self.num_steps += 1
        return outputs

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """Finish a request with `finish_reason="error"` and `message` (written for the client) as its error."""
        return self.updater.fail(request_id, message)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        return self.updater.update(sched, result)
