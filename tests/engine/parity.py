"""kiln's logits for prompts, read off one engine step, for parity tests against HF transformers."""

from __future__ import annotations

import torch

from kiln import LLM, SamplingParams


def kiln_batch_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One prefill step over every prompt: each prompt's rows of logits. Float32 activations and KV cache: these
    checks are of loading (every weight where HF puts it) at 1e-4, which int8 activations' or a bfloat16 cache's
    rounding would blur."""
    engine = LLM(path, num_kv_blocks=32, graph_mode="eager", activations="float32", kv_cache_dtype="float32").engine
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=1, temperature=0))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(prompts)  # one step, one batch
    logits = engine.model.compute_logits(engine.runner.forward(engine.runner.prepare(sched)))
    return list(logits[: sum(map(len, prompts))].split([len(p) for p in prompts]))
