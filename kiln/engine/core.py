"""EngineCore: the step, schedule -> execute -> update, and the requests it serves.

It is handed a loaded model, its tokenizer and an executor (by `kiln.engine.build.build_engine`, or by the
debugger, which runs several executors over one model); it owns the KV block pool, the scheduler and the runner.
Admission (kiln.engine.admission) and the stop rules and outputs (kiln.engine.outputs) live in modules of their own.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from torch import nn

from kiln.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, ModelConfig
from kiln.engine.admission import Admission
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.kv_cache import BlockPool
from kiln.engine.kv_plan import kv_budget, kv_cache_blocks, log_kv_cache
from kiln.engine.model_runner import ModelRunner, StepObserver
from kiln.engine.outputs import request_output, stop_after
from kiln.engine.prefix_sharing import prefix_keys_for
from kiln.engine.rank_role import SINGLE_DEVICE, RankRole
from kiln.engine.request import Request, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.scheduler_output import SchedulerOutput
from kiln.engine.speculation import Speculator
from kiln.engine.step_sample import ModelRunnerOutput
from kiln.engine.step_shape import StepShaper
from kiln.engine.structured_output import Grammars
from kiln.errors import RequestError, WorkerFailure
from kiln.executor.base import Executor
from kiln.model.dtypes import parse_dtype
from kiln.model.tokenizer import KilnTokenizer
from kiln.recipe.guards import RecipeViolation

if TYPE_CHECKING:
    from kiln.distributed.workers import Workers

logger = logging.getLogger("kiln")

INTERNAL_ERROR = "internal error while running this request; the server log has the details"


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
        kv_dtype = dtype if cc.dtype == "auto" else parse_dtype(cc.dtype)
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
            observer,
            self.shaper,
            blocks[1],
            role,
        )
        if self.recipe is not None and not self.shaper.fits(1, 1):  # the executor is prepared: pad_to is known
            self.shaper.check(1, 1, [])  # raises RecipeViolation naming the constraints that forbid every step
        window = mc.uniform_sliding_window or mc.hybrid_sliding_window
        # speculative decoding's proposer (kiln.engine.speculation): the scheduler asks it for drafts, the step times it
        self.speculator = Speculator.for_config(config.speculative, self.max_model_len)
        namespace = f"{checkpoint_path or config.model}|{config.quantization}|{config.activations}|{kv_dtype}"
        self.scheduler = Scheduler(
            config.scheduler, self.pool, self.shaper, window, self.window_pool, role.steps_in_flight,
            prefix_keys_for(cc, mc, namespace), self.speculator,
        )  # fmt: skip
        log_kv_cache(cc, blocks, self.runner.kv_cache_bytes, kv_dtype, self.max_model_len, mc, budget_reason)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.workers: Workers | None = role.workers  # the other ranks, when this is rank 0 of a multi-device engine
        self.pipeline = step_loop
        self.grammars = Grammars(tokenizer.tokenizer, mc.vocab_size, self.eos_token_ids) if tokenizer else None
        self.admission = Admission(
            tokenizer,
            mc.vocab_size,
            self.max_model_len,
            self.recipe,
            self.shaper,
            config.scheduler.enable_chunked_prefill,
            self.scheduler.blocks_short,
            config.seed,
            self.grammars,
        )
        self.num_steps = 0

    @staticmethod
    def default_max_model_len(model_config: ModelConfig) -> int:
        return min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    @property
    def executor(self) -> Executor:
        return self.runner.executor

    # -- requests ---------------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, forced_output: list[int] | None = None
    ) -> Request:
        """Tokenize and validate; raises RequestError (naming the request) without touching engine state."""
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}", request_id)
        return self.admission.make_request(request_id, prompt, params, forced_output)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, forced_output: list[int] | None = None
    ) -> Request:
        """Queue a request; `forced_output` teacher-forces its output tokens (see `Request.forced_output`)."""
        req = self.make_request(request_id, prompt, params, forced_output)
        self.requests[request_id] = req
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, req)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        if (req := self.requests.get(request_id)) is None:
            return None
        self.scheduler.finish(req, "abort")
        return self._output(req, num_new=0)

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
        self.check_alive()
        if self.pipeline is not None:  # steps in flight on a pipeline
            return self.pipeline.step(self)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
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
        if (req := self.requests.get(request_id)) is None:
            return None
        req.error = message
        self.scheduler.finish(req, "error")
        return self._output(req, num_new=0)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in sched.scheduled:
            if (req := s.request).is_finished:
                continue  # aborted while its step was in flight (kiln.engine.step_pipeline)
            drafts = s.spec_token_ids
            self.scheduler.advance(req, s.num_new_tokens - len(drafts))  # drafts count once accepted (below)
            if req.request_id in result.errors:
                outputs.append(self.fail(req.request_id, result.errors[req.request_id]))
                continue
            tokens = result.sampled.get(req.request_id)
            if tokens is None:
                continue  # a prefill chunk that does not reach the end of the sequence yet
            if (out := self._emit(req, tokens, result.logprobs.get(req.request_id), now)) is not None:
                outputs.append(out)
            if drafts:
                self.scheduler.verified(req, len(drafts), len(tokens) - 1)
        return outputs

    def _emit(
        self, req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None, now: float
    ) -> RequestOutput | None:
        """Append a step's tokens to `req` up to the first that stops it; each token after the first was a draft
        the step accepted, so its K/V is computed too."""
        forced, start = req.forced_output, len(req.output_token_ids)
        for i, token in enumerate(tokens):
            if i:
                self.scheduler.advance(req, 1)
            if forced is not None and len(req.output_token_ids) < len(forced):
                token = forced[len(req.output_token_ids)]
            req.output_token_ids.append(token)
            if req.grammar is not None:
                try:
                    req.grammar.advance(token)
                except RequestError as exc:  # a forced token outside the grammar: this request alone fails
                    return self.fail(req.request_id, str(exc))
            if logprobs:
                req.logprobs.append(logprobs[i])
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            try:
                finish = stop_after(
                    req, token, self.detokenizers[req.request_id], self.eos_token_ids, self.max_model_len
                )
                if finish is not None:
                    self.scheduler.finish(req, *finish)
                    break
            except Exception:  # detokenizing this request's tokens failed: only this request is affected
                logger.exception("request %s: finishing the step's update failed; failing the request", req.request_id)
                return self.fail(req.request_id, INTERNAL_ERROR)
        return self._output(req, num_new=len(req.output_token_ids) - start)

    def _output(self, req: Request, num_new: int) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        out = request_output(req, detok, num_new)
        if out.finished:
            self.requests.pop(req.request_id, None)
            self.detokenizers.pop(req.request_id, None)
        return out
