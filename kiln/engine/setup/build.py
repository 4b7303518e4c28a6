"""`build_engine(config)`: the one way an engine is made, for the CLI, `LLM`, the server, `kiln compile`, the
debugger and the bench alike. It loads the checkpoint, the model and the tokenizer, and hands them to `build_core`,
which picks the executor from the registry below and makes the `EngineCore` (the debugger calls `build_core` itself
for its engines over a model it already holds).

`EXECUTORS` is the executor registry: a new way to run the forward is a subclass of `kiln.executor.base.Executor`
and one entry here, chosen by `EngineConfig.executor`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch._inductor import config as inductor_config

from kiln.compile.fusion_check import check_quantized
from kiln.config import EngineConfig, ModelConfig
from kiln.distributed.state import RankState, rank_state
from kiln.distributed.workers import Workers, follow, start_ranks
from kiln.engine.core import EngineCore, MakeSpeculator
from kiln.engine.running.model_runner import StepObserver
from kiln.engine.running.rank_role import RankRole, rank_role
from kiln.engine.setup.resolve import resolve_for_model
from kiln.engine.speculation.draft import DraftModel, draft_engine_config
from kiln.engine.speculation.speculation import Speculator
from kiln.errors import ConfigError
from kiln.executor.base import Executor
from kiln.executor.eager import EagerExecutor
from kiln.executor.graph import GraphExecutor
from kiln.lora import LoRALimits, LoRAManager, LoRARequest, attach_lora
from kiln.model.build import build_model, load_tokenizer, run_quantization
from kiln.model.dtypes import parse_dtype
from kiln.model.loader import Checkpoint, open_checkpoint
from kiln.model.parallel import check_parallel
from kiln.model.tokenizer import KilnTokenizer
from kiln.platforms import platform_of

logger = logging.getLogger("kiln")
INDUCTOR_COMPILE_THREADS = inductor_config.compile_threads  # inductor's own choice (the cores), before any engine

EXECUTORS: dict[str, Callable[[EngineConfig], Executor]] = {
    "eager": lambda config: EagerExecutor(
        config.graph.cache_dir,
        activations=config.activations,
        head_rows=config.sampled_rows,
        second_form_gb=config.second_form_memory_gb,
    ),
    "graph": lambda config: GraphExecutor(
        config.graph,
        activations=config.activations,
        head_rows=config.sampled_rows,
        second_form_gb=config.second_form_memory_gb,
    ),
}


def make_executor(config: EngineConfig) -> Executor:
    return EXECUTORS[config.executor](config)


def apply_device_settings(config: EngineConfig) -> None:
    """Check the device exists and set torch's thread count (resolved: --num-threads, else KILN_NUM_THREADS; None:
    torch's own, all cores). Inductor compiles with no more workers than that: with one thread it compiles in this
    process instead of starting a pool of compile processes (2 s of every graph-mode start, cached or not)."""
    if not platform_of(config.device).is_available():
        raise ConfigError(f"device {config.device!r} was asked for but torch sees no such device; use --device cpu")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
        inductor_config.compile_threads = min(INDUCTOR_COMPILE_THREADS, config.num_threads)


def build_engine(config: EngineConfig, observer: StepObserver | None = None) -> EngineCore:
    """Load `config.model` and build an engine around it; `observer` sees every step (the debugger's taps).

    With more than one rank (`config.parallel`) the first call starts the other ranks (kiln.distributed.workers)
    and this process loads its own shard; a process that is not rank 0 follows rank 0's steps and exits when told.
    """
    apply_device_settings(config)
    checkpoint = open_checkpoint(config.model)
    state, workers = rank_state(), None
    if state is not None and state.spmd:  # every rank runs the debugger's program, which builds its own engines
        return load_core(config, checkpoint, observer, state)
    if state is not None and state.is_driver:
        raise ConfigError(
            "a multi-device engine is already running in this process: close() it before building another"
        )
    if config.parallel.is_distributed and state is None:
        check_parallel(checkpoint.config, config.parallel)  # before any rank starts
        state, workers = start_ranks(config, build_engine)
    try:
        core = load_core(config, checkpoint, observer, state=state, workers=workers)
    except BaseException:
        if workers is not None:  # this rank failed: the ranks it started must not wait for it
            workers.abort()
        raise
    if state is None or state.is_driver or workers is None:
        return core
    # the first rank of another node: it follows rank 0 like the ranks it started
    assert workers.channel is not None
    steps = follow(core, workers.channel)
    logger.info("Rank %d ran %d steps for rank 0, which has stopped: exiting", state.rank, steps)
    workers.stop()
    raise SystemExit(0)


def speculator_maker(config: EngineConfig) -> MakeSpeculator:
    """The step's proposer of an engine built from `config`: n-gram speculation, or the draft method's model in an
    engine of its own, built first and handed to the speculator (None: speculation off)."""

    def make(target: ModelConfig, max_model_len: int, num_blocks: int) -> Speculator | None:
        spec = config.speculative
        if not spec.is_enabled:
            return None
        drafter = build_draft(config, target, max_model_len, num_blocks) if spec.method == "draft" else None
        return Speculator(spec, max_model_len, drafter)

    return make


def build_draft(config: EngineConfig, target: ModelConfig, max_model_len: int, num_blocks: int) -> DraftModel:
    """The draft method's model (kiln.engine.speculation.draft), in an engine of its own, sized as the target's."""
    draft = open_checkpoint(config.speculative.draft_model)
    draft_config = draft_engine_config(config, target, max_model_len=max_model_len, num_blocks=num_blocks, draft=draft)
    logger.info(
        "Speculative decoding: draft model %s (%d layers) proposes up to %d tokens per step; building its engine",
        draft.path,
        draft.config.num_layers,
        config.speculative.num_speculative_tokens,
    )
    return DraftModel(load_core(draft_config, draft, None, detokenize=False))


def engine_role(
    config: EngineConfig, model: nn.Module, executor: Executor, state: RankState | None, workers: Workers | None = None
) -> RankRole:
    """The role of an engine over `model` on this rank (kiln.engine.running.rank_role); a single device:
    `RankRole()`."""
    if state is None:
        return RankRole()
    return rank_role(
        state,
        config.parallel,
        model,
        compute_logits=executor.compute_logits,
        vocab_size=model.config.vocab_size,
        workers=workers,
    )


def load_core(
    config: EngineConfig,
    checkpoint: Checkpoint,
    observer: StepObserver | None,
    state: RankState | None = None,
    workers: Workers | None = None,
    detokenize: bool = True,
) -> EngineCore:
    """Load `checkpoint`'s model (and, with `detokenize`, its tokenizer: False serves token ids only, a draft
    model's) under `config` resolved for it (kiln.engine.setup.resolve.resolve_for_model), then `build_core`."""
    resolved = resolve_for_model(config, checkpoint.config, lambda asked: run_quantization(checkpoint, asked))
    model = build_model(
        checkpoint,
        parse_dtype(resolved.dtype),
        max_positions=resolved.max_model_len,
        device=resolved.device,
        quantization=resolved.quantization,
        group_size=resolved.quantization_group_size,
    )
    return build_core(
        resolved,
        model,
        tokenizer=load_tokenizer(checkpoint) if detokenize else None,
        checkpoint_path=checkpoint.path,
        observer=observer,
        state=state,
        workers=workers,
        # NOTE: the config as given: a draft model resolves what its own checkpoint decides (quantization auto)
        make_speculator=speculator_maker(config),
    )


def build_core(
    config: EngineConfig,
    model: nn.Module,
    *,
    tokenizer: KilnTokenizer | None = None,
    executor: Executor | None = None,
    checkpoint_path: str = "",
    observer: StepObserver | None = None,
    state: RankState | None = None,
    workers: Workers | None = None,
    make_speculator: MakeSpeculator | None = None,
    lora: LoRAManager | None = None,
) -> EngineCore:
    """An engine over a loaded `model`, prepared: the one place an `EngineCore` is made, for `build_engine` and the
    debugger's engines alike. `config` is resolved for the model here (a no-op when it already is);
    `executor` None: the registry's for `config` (EXECUTORS); `state`/`workers`: this rank's part in a multi-device
    engine (None: a single device); `make_speculator` None: `speculator_maker(config)`; `lora`: the adapter slots
    `model` already holds (another engine over the same model, the debugger's eager reference; None:
    `lora_manager(config, model)` attaches them)."""
    config = resolve_for_model(config, model.config)
    check_quantized(model, config.graph.fusion_groups)
    # NOTE: before the executor prepares: the graphs take the adapters' buffers
    lora = lora if lora is not None else lora_manager(config, model)
    executor = executor or make_executor(config)
    core = EngineCore(
        config,
        model,
        tokenizer,
        executor,
        checkpoint_path=checkpoint_path,
        observer=observer,
        role=engine_role(config, model, executor, state=state, workers=workers),
        make_speculator=make_speculator or speculator_maker(config),
        lora=lora,
    )
    return core.prepare()


def lora_manager(config: EngineConfig, model: nn.Module) -> LoRAManager | None:
    """The model's LoRA adapter slots (kiln.lora) with `--lora-modules` registered (ids 1, 2, ... in order); None
    unless --enable-lora. Each module is read and checked now: a bad one stops the start with its AdapterError."""
    lora = config.lora
    if not lora.enabled:
        return None
    # NOTE: a step's padded size: its token budget, or a capture size above it
    max_tokens = config.scheduler.max_num_batched_tokens + max(config.graph.capture_sizes, default=0)
    limits = LoRALimits(
        max_loras=lora.max_loras,
        max_rank=lora.max_lora_rank,
        max_num_tokens=max_tokens,
        target_modules=lora.target_modules,
        dtype=lora.dtype,
    )
    manager = LoRAManager(attach_lora(model, limits), lora.cpu_loras)
    for i, (name, path) in enumerate(lora.modules, start=1):
        manager.add(LoRARequest(name, i, path))
    logger.info(
        "LoRA: %d adapter slots of rank <= %d, %d host copies; %d adapters registered",
        lora.max_loras,
        lora.max_lora_rank,
        lora.cpu_loras,
        len(lora.modules),
    )
    return manager
