"""A recipe drives the engine: its settings apply, and its guards fail only the offending request."""

from __future__ import annotations

from pathlib import Path

from kiln import LLM, SamplingParams

RECIPE = Path(__file__).parents[2] / "recipes" / "smollm2-135m.yaml"


def eager_recipe(tmp_path: Path, seq_len_bound: int) -> Path:
    text = RECIPE.read_text()
    text = text.replace("seq_len <= 2048", f"seq_len <= {seq_len_bound}")
    text = text.replace("mode: full_and_piecewise", "mode: eager")
    # nothing is split, captured or compiled under eager: the splitting ops, sizes and compiler would do nothing
    # (refused)
    graph_only = ", splitting_ops: [kiln.attention], capture_sizes: [1, 2, 4, 8, 16, 32], compiler: inductor"
    text = text.replace(graph_only, "")
    text = text.replace("silu, mul]}", "silu, mul], required: false}")  # eager runs generate no code to fuse
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_guard_violation_fails_only_that_request(tmp_path: Path) -> None:
    path = eager_recipe(tmp_path, 64)
    llm = LLM(recipe=str(path))
    assert llm.engine.pool.block_size == 16 and llm.engine.pool.num_blocks == 1024  # memory_plan applied
    assert llm.engine.max_model_len == 64  # the seq_len bound
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "seq_len <= 64" in t)
    outs = llm.generate(["word " * 70, "The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert outs[0].finish_reason == "error"
    assert outs[0].error.startswith(f"{path}:{line}: seq_len <= 64 violated: got seq_len=")
    assert "(request " in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8
    assert llm.engine.config.graph_mode == "eager" and llm.engine.executor.name == "eager"
