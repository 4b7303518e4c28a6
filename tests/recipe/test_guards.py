"""Run-time guards: a violation is a RequestError subclass naming recipe.yaml:LINE and the request id."""

from __future__ import annotations

import builtins

import pytest

from kiln.errors import RequestError
from kiln.recipe import RecipeViolation, load_recipe

RECIPE = """\
recipe_version: 1
model: {name: smollm2-135m-instruct, path: default}
weights: {dtype: float32, source_quantization: q4_1}
input_constraints:
  constraints:
    - num_tokens <= 2048
    - batch_size <= 64
    - num_tokens % 2 == 0 or num_tokens < 32
    - seq_len <= 2048
    - seq_len * batch_size <= 65536
    - hidden_size % num_heads == 0
"""


@pytest.fixture
def guards(write):
    return load_recipe(write(RECIPE)).guards


def test_request_violation_names_the_line_and_request(guards) -> None:
    with pytest.raises(RecipeViolation) as info:
        guards.check_request("3", seq_len=4096)
    assert isinstance(info.value, RequestError)
    assert str(info.value) == "recipe.yaml:9: seq_len <= 2048 violated: got seq_len=4096 (request 3)"
    assert (info.value.request_id, info.value.file, info.value.line, info.value.param) == (
        "3",
        "recipe.yaml",
        9,
        "seq_len",
    )


def test_valid_request_and_step_pass(guards) -> None:
    """Values at each constraint's edge pass (no exception) and one past it is refused, so the pass is the guards
    checking, not the guards doing nothing."""
    assert guards.check_request("1", seq_len=2048) is None
    with pytest.raises(RecipeViolation, match="seq_len <= 2048"):
        guards.check_request("1", seq_len=2049)
    assert guards.check_step(num_tokens=2048, batch_size=64, seq_lens=[1024] * 64) is None
    with pytest.raises(RecipeViolation, match="seq_len \\* batch_size <= 65536"):
        guards.check_step(num_tokens=2048, batch_size=64, seq_lens=[1024] * 63 + [1025])
    with pytest.raises(RecipeViolation, match="batch_size <= 64"):
        guards.check_step(num_tokens=2048, batch_size=65)
    assert guards.check_step(num_tokens=31, batch_size=1) is None


def test_step_violation(guards) -> None:
    with pytest.raises(RecipeViolation) as info:
        guards.check_step(num_tokens=33, batch_size=4)
    assert str(info.value) == "recipe.yaml:8: num_tokens % 2 == 0 or num_tokens < 32 violated: got num_tokens=33"
    assert info.value.request_id is None


def test_mixed_constraint_checked_per_sequence(guards) -> None:
    with pytest.raises(
        RecipeViolation,
        match=r"^recipe.yaml:10: seq_len \* batch_size <= 65536 violated: "
        r"got batch_size=64, seq_len=2000$",
    ):
        guards.check_step(num_tokens=64, batch_size=64, seq_lens=[10, 2000])


def test_guards_never_call_eval(guards, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("eval/exec must never run")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    with pytest.raises(RecipeViolation):
        guards.check_request("7", seq_len=5000)
    guards.check_step(num_tokens=16, batch_size=2)


def test_engine_settings_from_the_recipe(write) -> None:
    recipe = load_recipe(write(RECIPE))
    assert (recipe.max_num_batched_tokens, recipe.max_num_seqs, recipe.max_model_len) == (2048, 64, 2048)
    assert (recipe.dtype, recipe.kv_cache_dtype, recipe.block_size, recipe.max_pages) == (
        "float32",
        "auto",
        16,
        1024,
    )
    assert (recipe.graph_mode, recipe.splitting_ops, recipe.compiler, recipe.debug_mode) == (
        "full_and_piecewise",
        ["kiln.attention"],
        "inductor",
        False,
    )
    assert recipe.capture_sizes == [1, 2, 4, 8, 16, 32]
    assert recipe.fusion_groups == []


def test_guards_are_built_once(write) -> None:
    recipe = load_recipe(write(RECIPE))
    assert recipe.guards is recipe.guards
