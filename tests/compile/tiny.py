"""Graph-mode test helpers: a tiny random Llama, a runner around it, a greedy generate loop, metadata."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.compile.settings import graph_config_from
from kiln.config import ModelConfig, SchedulerConfig
from kiln.engine.request import Request
from kiln.engine.running.model_runner import ModelRunner
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.scheduler import Scheduler
from kiln.engine.speculation.speculation import Speculator
from kiln.executor.base import Executor
from kiln.executor.eager import EagerExecutor
from kiln.executor.graph import GraphExecutor
from kiln.model.forward_context import AttentionMetadata
from kiln.model.llama import LlamaForCausalLM

NUM_BLOCKS = 64
BLOCK_SIZE = 4


def tiny_config(num_layers: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        name="tiny-random",
    )


def tiny_model(num_layers: int = 2, seed: int = 0, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(num_layers), 256)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            torch.nn.init.uniform_(param, 0.8, 1.2)
        else:
            torch.nn.init.normal_(param, std=0.2)
    return model.to(device).eval().requires_grad_(False)


def make_runner(model: LlamaForCausalLM, executor: Executor | None = None) -> ModelRunner:
    """A runner over `model` (default: its own forward, weights left as they are)."""
    param = next(model.parameters())
    # NOTE: ModelRunner allocates the KV caches and builds its inputs on the model's device itself.
    executor = executor or EagerExecutor(keep_layout=True)
    runner = ModelRunner(model, executor, NUM_BLOCKS, BLOCK_SIZE, param.dtype, eos_token_ids=())
    runner.prepare_executor()
    return runner


def graph_runner(model: LlamaForCausalLM, cache_dir: Path, **overrides: object) -> tuple[ModelRunner, GraphExecutor]:
    overrides.setdefault("capture_sizes", (1, 2, 4))
    overrides.setdefault("compile_sizes", ())  # static compiles have their own tests (test_static_sizes.py)
    overrides.setdefault("mode", "piecewise")  # the full decode graph has its own tests (test_graph_modes.py)
    graph = GraphExecutor(graph_config_from(None, cache_dir=str(cache_dir), **overrides))
    return make_runner(model, graph), graph


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    speculator: Speculator | None = None,
) -> list[list[int]]:
    """Greedy continuous-batching generation through `runner` (prefill and decode steps, as the engine runs); a
    small `max_num_batched_tokens` chunks prompts, so steps mix decodes and prefill chunks. With `speculator`,
    decoding sequences verify its draft tokens (an accepted draft's K/V counts as computed, as the engine does)."""
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    scheduler = Scheduler(config, pool, speculator=speculator)
    requests = [
        Request(str(i), None, p, SamplingParams(temperature=0.0, max_tokens=max_tokens), None)
        for i, p in enumerate(prompts)
    ]
    for req in requests:
        scheduler.add(req)
    while scheduler.has_unfinished:
        sched = scheduler.schedule()
        result = runner.execute(sched)
        for s in sched.scheduled:
            req, drafts = s.request, s.spec_token_ids
            tokens = result.sampled.get(req.request_id)
            req.num_computed_tokens += s.num_new_tokens - len(drafts) + (len(tokens) - 1 if drafts else 0)
            if tokens is None:
                continue
            req.output_token_ids += tokens[: max_tokens - len(req.output_token_ids)]
            if drafts:
                scheduler.verified(req, len(drafts), len(tokens) - 1)
            if len(req.output_token_ids) >= max_tokens:
                scheduler.finish(req, "length")
    return [r.output_token_ids for r in requests]


def random_prompts(lengths: list[int], vocab: int = 128, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def prefill_metadata(num_tokens: int) -> AttentionMetadata:
    """One sequence whose whole prompt (`num_tokens` tokens) runs in this step, in blocks 0, 1, ..."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_decodes=0,
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        seq_lens_tensor=torch.tensor([num_tokens]),
        block_tables=torch.arange(num_blocks)[None],
        block_size=BLOCK_SIZE,
    )
