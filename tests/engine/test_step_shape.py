"""Step constraints shape every step: batches are padded to the shapes the recipe allows (through the executor's
own padding), a request no step can take is refused up front naming the line, and `check_step` runs on every step
so a step that breaks a constraint fails its requests, never silently."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.engine.scheduling.step_shape import StepShaper
from kiln.recipe import RecipeViolation, load_recipe_text

# The community example's own step constraints (batch_size % 4, seq_len <= 2048) and a token multiple.
COMMUNITY = """\
recipe_version: 1
model: {{name: smollm2-135m-instruct}}
weights: {{source_quantization: q4_1}}
input_constraints:
  constraints:
    - batch_size % 4 == 0
    - num_tokens % 8 == 0
    - seq_len <= 2048
    - num_tokens <= {max_tokens}
{extra}graph: {{piecewise: false, mode: eager}}
memory_plan: {{kv_cache: {{max_pages: 256}}}}
hardware: {{device: cpu}}
"""


def community(max_tokens: int = 256, extra: str = "") -> str:
    return COMMUNITY.format(max_tokens=max_tokens, extra=extra)


def shaper(text: str, pad_to=lambda n: n) -> StepShaper:
    recipe = load_recipe_text(text, "recipe.yaml")
    return StepShaper(recipe.guards, pad_to, recipe.bounds["num_tokens"], recipe.bounds["batch_size"] or 64)


def test_padding_reaches_the_next_allowed_shape() -> None:
    s = shaper(community())
    assert s.shape(5, 1) == (8, 4)  # three padding sequences (a token each), then tokens up to a multiple of 8
    assert s.shape(1, 1) == (8, 4)
    assert s.shape(9, 4) == (16, 4)
    assert s.shape(13, 5) == (16, 8)
    assert s.shape(256, 4) == (256, 4)
    assert s.shape(255, 3) == (256, 4)
    assert s.shape(254, 1) is None  # three padding sequences need a 257th token, beyond num_tokens <= 256


def test_the_executor_padding_is_part_of_the_search() -> None:
    captured = [8, 24]
    s = shaper(community(), pad_to=lambda n: next((c for c in captured if c >= n), n))
    assert s.shape(9, 4) == (24, 4)  # 16 is allowed but the executor would run it as 24, which is allowed too
    odd = shaper(community(extra="    - num_tokens != 24\n"), pad_to=lambda n: next((c for c in captured if c >= n), n))
    assert odd.shape(9, 4) == (25 + 7, 4)  # 16 and 24 run as 24, which is refused; 32 runs as itself


def test_check_names_the_line_when_no_shape_exists() -> None:
    s = shaper(community())
    with pytest.raises(RecipeViolation) as info:
        s.check(254, 1, [])
    assert str(info.value).startswith("no step shape the recipe allows holds 254 tokens of 1 sequences")
    assert "recipe.yaml:6: batch_size % 4 == 0" in str(info.value)


def test_chunks_are_cut_so_the_step_still_fits() -> None:
    s = shaper(community(max_tokens=16))
    assert s.largest_fit(0, 1, 16) == 13  # 13 real tokens + 3 padding sequences = 16
    assert s.largest_fit(12, 2, 4) == 2  # 14 + 2 padding sequences = 16


def recorded_run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list, list[str]]:
    shapes: list[tuple[int, int, int]] = []
    forward = llm.engine.runner.forward

    def record(inputs):
        shapes.append((inputs.input_ids.shape[0], inputs.batch_size, inputs.metadata.num_actual_tokens))
        return forward(inputs)

    llm.engine.runner.forward = record
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return shapes, [o.text for o in outs]


@pytest.fixture(scope="module")
def unconstrained() -> LLM:
    return LLM(num_kv_blocks=256, graph_mode="eager")


def test_a_lone_five_token_request_runs_padded_and_unchanged(tmp_path: Path, unconstrained: LLM) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(community())
    shapes, texts = recorded_run(LLM(recipe=str(path)), ["The capital of France is"], 4)
    assert shapes[0][2] == 5 and all(s[:2] == (8, 4) for s in shapes)  # every step padded to an allowed shape
    assert len(shapes) == 4
    assert texts == [
        o.text
        for o in unconstrained.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    ]


def test_a_long_prompt_is_chunked_to_fit(tmp_path: Path, unconstrained: LLM) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(community(max_tokens=16))
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    shapes, texts = recorded_run(LLM(recipe=str(path)), [prompt], 3)
    assert shapes[0] == (16, 4, 13)  # the first chunk leaves room for the padding sequences
    assert all(s[0] % 8 == 0 and s[1] % 4 == 0 and s[0] <= 16 for s in shapes)
    assert texts == [o.text for o in unconstrained.generate([prompt], SamplingParams(max_tokens=3, temperature=0))]


def test_a_request_no_step_can_take_is_refused_up_front(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(community(max_tokens=16))
    llm = LLM(recipe=str(path), enable_chunked_prefill=False)
    long_prompt = " ".join(["word"] * 20)
    outs = llm.generate([long_prompt, "Hi"], SamplingParams(max_tokens=2, temperature=0))
    assert outs[0].finish_reason == "error"
    assert outs[0].error.startswith("the prompt (20 tokens) can never be scheduled: no step shape the recipe")
    assert f"{path}:9: num_tokens <= 16" in outs[0].error and "(request 0)" in outs[0].error
    assert outs[1].finish_reason == "length"


def test_a_seq_len_constraint_broken_mid_generation_is_refused_up_front(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(community(extra="    - seq_len % 2 == 1 or seq_len < 8\n"))
    outs = LLM(recipe=str(path)).generate(["Hi"], SamplingParams(max_tokens=10, temperature=0))
    assert outs[0].finish_reason == "error"
    assert outs[0].error.startswith(f"{path}:10: seq_len % 2 == 1 or seq_len < 8 violated: got seq_len=8")


def test_a_step_breaking_a_mixed_constraint_fails_its_requests(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(community(extra="    - num_tokens <= 8 or seq_len <= 16\n"))
    llm = LLM(recipe=str(path))
    outs = llm.generate([" ".join(["word"] * 20), "Hello there"], SamplingParams(max_tokens=4, temperature=0))
    assert [o.finish_reason for o in outs] == ["error", "error"]  # one prefill step of 22 tokens holds both
    expected = f"{path}:10: num_tokens <= 8 or seq_len <= 16 violated: got num_tokens=24, seq_len=20"
    assert [o.error for o in outs] == [expected, expected]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks  # the failed step freed its KV blocks
    again = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))  # the engine goes on
    assert again[0].finish_reason == "length"


def test_constraints_mixing_seq_len_are_checked_without_step_constraints() -> None:
    text = community().replace("    - batch_size % 4 == 0\n    - num_tokens % 8 == 0\n", "")
    text = text.replace("    - num_tokens <= 256\n", "    - num_tokens <= 8 or seq_len <= 16\n")
    recipe = load_recipe_text(text, "recipe.yaml")
    s = StepShaper(recipe.guards, lambda n: n, 256, 64)
    assert not recipe.guards.step_constraints and s.check(24, 2, [16, 8]) == (24, 2)  # nothing to shape
    with pytest.raises(RecipeViolation, match=r"recipe.yaml:7: num_tokens <= 8 or seq_len <= 16 violated"):
        s.check(24, 2, [20, 4])
