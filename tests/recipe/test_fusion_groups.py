"""Fusion groups at validation: a group cannot span attention, and every group's recipe line reaches the compiler."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kiln.compile.settings import graph_config_from
from kiln.config import GraphConfig
from kiln.recipe import load_recipe

BOUNDS = "input_constraints: {constraints: [num_tokens <= 2048, seq_len <= 2048]}\n"


@pytest.mark.parametrize(
    ("ops", "after", "before", "cited"),
    [
        ("[q_proj, o_proj]", "o_proj", "q_proj", "o_proj"),
        ("[gate_proj, up_proj, rotary_emb]", "gate_proj", "rotary_emb", "rotary_emb"),
        ("[post_attention_layernorm, input_layernorm]", "post_attention_layernorm", "input_layernorm", "input_"),
    ],
)
def test_group_across_attention_is_refused_at_its_line(
    header, write, only_error, ops: str, after: str, before: str, cited: str
) -> None:
    """The error points at the later of the two ops, on the group's line."""
    line = f"  - {{name: g, ops: {ops}}}"
    err = only_error(write(header + BOUNDS + f"fusion_groups:\n{line}\n"))
    assert (err.line, err.col) == (6, line.index(cited) + 1)
    assert err.message.startswith(f"fusion group g: {after!r} runs after attention and {before!r} before it")
    assert err.message.endswith("make them two groups")


@pytest.mark.parametrize(
    "ops", ["[q_proj, k_proj, rotary_emb]", "[add, rms_norm]", "[gate_proj, up_proj, silu, mul, down_proj]"]
)
def test_groups_on_one_side_of_attention_are_accepted(header, write, ops: str) -> None:
    recipe = load_recipe(write(header + BOUNDS + f"fusion_groups:\n  - {{name: g, ops: {ops}}}\n"))
    assert [d.format() for d in recipe.diagnostics] == []


def test_groups_carry_their_recipe_line_and_required_flag(header, write) -> None:
    text = (
        header
        + BOUNDS
        + "fusion_groups:\n"
        + "  - {name: mlp, ops: [gate_proj, up_proj, silu, mul]}\n"
        + "  - name: tail\n    ops: [silu, mul, down_proj]\n    required: false\n"
    )
    recipe = load_recipe(write(text))
    assert recipe.fusion_lines == (6, 7)
    mlp, tail = graph_config_from(recipe).fusion_groups
    assert (mlp.name, mlp.required, mlp.where) == ("mlp", True, "recipe.yaml:6")
    assert (tail.ops, tail.required, tail.where) == (("silu", "mul", "down_proj"), False, "recipe.yaml:7")


def test_shipped_recipe_group_is_kilns_default() -> None:
    """recipes/smollm2-135m.yaml asks for what kiln realises on its own model (tests/compile/test_fusion.py)."""
    path = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml")
    line = next(i for i, text in enumerate(Path(path).read_text().splitlines(), 1) if "name: mlp_fusion" in text)
    (group,) = graph_config_from(load_recipe(path)).fusion_groups
    # the same group as kiln's default, but promised: a recipe's groups are required unless it says otherwise
    default = GraphConfig().fusion_groups[0]
    assert group == replace(default, where=f"{path}:{line}", required=True) and not default.required
    assert group.ops == ("gate_proj", "up_proj", "silu", "mul")
