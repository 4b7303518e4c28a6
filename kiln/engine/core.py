"""EngineCore: the engine's parts, built once, and the requests it serves.

It is handed a loaded model, its tokenizer and an executor (by `kiln.engine.setup.build.build_engine`, or by the
debugger, which runs several executors over one model); it builds the KV block pool, the runner, the scheduler, the
step's proposer (speculative decoding) and the updater, and hands them to the step loop its role calls for
(kiln.engine.loop: propose -> schedule -> execute -> update). Admission (kiln.engine.scheduling.admission) checks
requests before they are queued. Construction allocates; `prepare()` is the executor's prepare phase (kernel plan,
trace, compile, capture), called once by whoever builds the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, ModelConfig
from kiln.engine.loop.parts import StepParts
from kiln.engine.loop.pipelined import PipelinedSteps
from kiln.engine.loop.plain import PlainSteps
from kiln.engine.output.updater import Updater
from kiln.engine.request import Request, RequestOptions, RequestOutput
from kiln.engine.running.kv_plan import kv_budget, kv_cache_blocks, log_kv_cache
from kiln.engine.running.model_runner import ModelRunner, StepObserver
from kiln.engine.running.rank_role import SINGLE_DEVICE, RankRole
from kiln.engine.running.step_sample import ModelRunnerOutput
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.admission import Admission
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.prefill_budget import attention_tokens_of
from kiln.engine.scheduling.prefix_sharing import cache_namespace, prefix_keys_for
from kiln.engine.scheduling.scheduler import Scheduler
from kiln.engine.scheduling.scheduler_output import SchedulerOutput
from kiln.engine.scheduling.step_shape import StepShaper
from kiln.engine.speculation.speculation import Speculator
from kiln.engine.structured.structured_output import Grammars
from kiln.errors import ConfigError, RequestError
from kiln.executor.base import Executor
from kiln.lora.manager import LoRAManager
from kiln.lora.request import LoRARequest
from kiln.model.kv_format import kv_dtype_name, kv_storage_dtype
from kiln.model.tokenizer import KilnTokenizer

if TYPE_CHECKING:
    from kiln.distributed.workers import Workers

logger = logging.getLogger("kiln")


# the step's proposer, made for the engine's model, context and KV pool (kiln.engine.setup.build builds a draft model's
# engine first and hands it to its speculator); None: no speculative decoding
MakeSpeculator = Callable[[ModelConfig, int, int], Speculator | None]


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
        make_speculator: MakeSpeculator | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        """`role`: this rank's part in a multi-device engine (kiln.engine.running.rank_role), which also chooses the
        step loop (kiln.engine.loop); `make_speculator`: the step's proposer (default: n-gram speculation when the
        config asks for it); `lora`: the model's LoRA adapter slots (kiln.lora; None: the base model alone). All
        fixed here."""
        self.lora = lora
        self.config = config
        self.recipe = config.recipe
        self.checkpoint_path = checkpoint_path
        self.model = model
        self.tokenizer = tokenizer
        mc: ModelConfig = model.config
        self.model_config = mc
        self.max_model_len = config.max_model_len or self.default_max_model_len(mc)
        self.eos_token_ids = self._eos_token_ids(mc, tokenizer)
        kv_dtype = kv_storage_dtype(config.cache.dtype, next(model.parameters()).dtype)  # "auto" resolved
        blocks, budget_reason = self._kv_blocks(model, kv_dtype)
        self.pool = BlockPool(blocks[0], config.cache.block_size)
        self.window_pool = BlockPool(blocks[1], config.cache.block_size) if blocks[1] else None
        self.shaper = StepShaper.for_engine(config, executor.pad_to)
        self.runner = ModelRunner(
            model=model,
            executor=executor,
            num_blocks=blocks[0],
            block_size=config.cache.block_size,
            kv_dtype=kv_dtype,
            eos_token_ids=self.eos_token_ids,
            observer=observer,
            shaper=self.shaper,
            window_blocks=blocks[1],
            role=role,
            head_rows=config.sampled_rows,
            pooling=config.pooling,
            lora=lora,
        )
        self.scheduler = self._scheduler(role, kv_dtype)
        log_kv_cache(
            cc=config.cache,
            blocks=blocks,
            nbytes=self.runner.kv_cache_bytes,
            kv_dtype=kv_dtype,
            max_model_len=self.max_model_len,
            mc=mc,
            reason=budget_reason,
            huge_bytes=self.runner.kv_cache_huge_bytes,
        )
        # speculative decoding's proposer (kiln.engine.speculation): it proposes before each step is scheduled
        make = make_speculator or self._ngram_speculator
        self.speculator = make(mc, self.max_model_len, self.pool.num_blocks)
        self.updater = Updater(
            self.scheduler,
            tokenizer,
            self.eos_token_ids,
            self.max_model_len,
            pooling=config.pooling,
            speculator=self.speculator,
        )
        self.workers: Workers | None = role.workers  # the other ranks, when this is rank 0 of a multi-device engine
        self.loop = self._step_loop(role)
        self.admission = self._admission(role)

    @staticmethod
    def _eos_token_ids(mc: ModelConfig, tokenizer: KilnTokenizer | None) -> tuple[int, ...]:
        eos = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return tuple(sorted(eos))

    def _step_loop(self, role: RankRole) -> PlainSteps | PipelinedSteps:
        """The step loop `role` calls for, over the parts built: steps in flight on a pipeline, else one at a time."""
        parts = StepParts(
            scheduler=self.scheduler,
            runner=self.runner,
            updater=self.updater,
            speculator=self.speculator,
            workers=self.workers,
        )
        return PipelinedSteps(parts, role.steps_in_flight) if role.defers_heads else PlainSteps(parts)

    def _kv_blocks(self, model: nn.Module, kv_dtype: torch.dtype) -> tuple[tuple[int, int], str]:
        """The KV blocks of every layer's pool and of a hybrid's sliding layers' (0: none), within the budget, and
        the budget's reason (for the start-up line)."""
        cc, p = self.config.cache, self.config.parallel
        budget, reason = kv_budget(cc, next(model.parameters()).device, max(1, p.world_size // p.nnodes))
        return kv_cache_blocks(cc=cc, sc=self.config.scheduler, model=model, kv_dtype=kv_dtype, budget=budget), reason

    def _scheduler(self, role: RankRole, kv_dtype: torch.dtype) -> Scheduler:
        config, mc = self.config, self.model_config
        model_name = self.checkpoint_path or config.model
        namespace = cache_namespace(model_name, config.quantization, config.activations, kv_dtype_name(kv_dtype))
        return Scheduler(
            config.scheduler,
            self.pool,
            self.shaper,
            window=mc.uniform_sliding_window or mc.hybrid_sliding_window,
            window_pool=self.window_pool,
            steps_in_flight=role.steps_in_flight,
            prefix_keys=prefix_keys_for(config.cache, mc, namespace),
            attention_tokens=attention_tokens_of(mc),
            max_loras=self.lora.slots.limits.max_loras if self.lora is not None else 0,
        )

    def _ngram_speculator(self, _: ModelConfig, max_model_len: int, __: int) -> Speculator | None:
        spec = self.config.speculative
        return Speculator(spec, max_model_len) if spec.is_enabled else None

    def _admission(self, role: RankRole) -> Admission:
        config, tokenizer, mc = self.config, self.tokenizer, self.model_config
        self.grammars = (
            Grammars(tokenizer.tokenizer, mc.vocab_size, self.eos_token_ids, config.grammar_cache_bytes)
            if tokenizer
            else None
        )
        return Admission(
            tokenizer=tokenizer,
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            recipe=self.recipe,
            shaper=self.shaper,
            chunked_prefill=config.scheduler.enable_chunked_prefill,
            blocks_short=self.scheduler.blocks_short,
            seed=config.seed,
            grammars=self.grammars,
            multi_device=role.head is not None,
        )

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
        self, request_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions | None = None
    ) -> Request:
        """Tokenize and validate; raises RequestError (naming the request) without touching engine state. A LoRA
        adapter (`options.lora`) is registered (read and checked) on first use: AdapterError when it does not fit."""
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}", request_id)
        priority = options.priority if options is not None else 0
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise RequestError(
                f"priority {priority} needs the priority scheduling policy; this engine schedules fcfs (start it "
                "with --scheduling-policy priority, or send priority 0)",
                request_id,
                "priority",
            )
        lora = options.lora if options is not None else None
        if lora is not None:
            if self.lora is None:
                raise RequestError(
                    f"adapter {lora.lora_name}: this engine serves no LoRA adapters (start it with --enable-lora)",
                    request_id,
                    "lora_request",
                )
            self.lora.add(lora)
        return self.admission.make_request(request_id, prompt, params, options)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        forced_output: list[int] | None = None,
        *,
        priority: int = 0,
        group: str | None = None,
        keeps_probs: bool = False,
        lora: LoRARequest | None = None,
    ) -> Request:
        """Queue a request, held as kiln.engine.request.RequestOptions says: `forced_output` teacher-forces its output
        tokens, `priority` orders it under the priority scheduling policy (lower first), `group` names the client
        request it belongs to (n > 1), `keeps_probs` marks a draft engine's request, `lora` is its adapter."""
        forced = tuple(forced_output) if forced_output is not None else None
        options = RequestOptions(
            forced_output=forced, priority=priority, group=group, keeps_probs=keeps_probs, lora=lora
        )
        req = self.make_request(request_id, prompt, params, options)
        self.updater.track(req)
        self.scheduler.add(req)
        return req

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Register adapter `name` from `path` (read and checked now: AdapterError, and nothing changes, when it does
        not fit) under the next free id; ConfigError without LoRA or when the name is taken."""
        if self.lora is None:
            raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")
        if self.lora.by_name(name) is not None:
            raise ConfigError(f"adapter {name!r} is loaded already: unload it first, or choose another name")
        lora = LoRARequest(name, max(self.lora.requests, default=0) + 1, path)
        self.lora.add(lora)
        return lora

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (its slot cleared); ConfigError when it is unknown or a request still runs with it."""
        found = self.lora.by_name(name) if self.lora is not None else None
        if found is None:
            raise ConfigError(f"no adapter {name!r} is loaded")
        if any(r.lora_id == found.lora_int_id for r in self.requests.values()):
            raise ConfigError(f"adapter {name!r} serves requests now: unload it once they finish")
        self.lora.remove(found.lora_int_id)

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
        """One step of the loop chosen at construction: propose -> schedule -> execute -> update (kiln.engine.loop)."""
        if not self.runner.is_prepared:
            raise RuntimeError("EngineCore.prepare() must run before the first step (kiln.engine.setup.build does it)")
        self.check_alive()
        return self.loop.step()

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """Finish a request with `finish_reason="error"` and `message` (written for the client) as its error."""
        return self.updater.fail(request_id, message)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        return self.updater.update(sched, result)
