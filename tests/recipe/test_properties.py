"""Property tests: random YAML and random recipe-shaped data (kiln's shape and the community one) are accepted or
rejected with a RecipeError, never with any other exception; `migrate` turns them into recipe text or a RecipeError."""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from kiln.recipe import RecipeError, load_recipe_text
from kiln.recipe.migrate import migrate_text
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.source import parse_source

KEYS = [
    "recipe_version",
    "model",
    "name",
    "path",
    "input_constraints",
    "constraints",
    "hidden_states",
    "shape",
    "dtype",
    "weights",
    "source_quantization",
    "quantization",
    "group_size",
    "fusion_groups",
    "ops",
    "memory_plan",
    "kv_cache",
    "block_size",
    "max_pages",
    "layout",
    "graph",
    "piecewise",
    "splitting_ops",
    "capture_sizes",
    "compiler",
    "hardware",
    "memory_budget_gb",
    "debug",
    "debug_mode",
    "bogus",
    # the community shape (kiln.recipe.community)
    "model_name",
    "model_path",
    "layer_type",
    "version",
    "input_ids",
    "hardware_preference",
    "gpu_arch",
    "power_limit_watts",
    "memory_pool_config",
    "pool_size_gb",
    "device_affinity",
    "device",
    "fusion_groups",
    "constraint",
    "all_ops_quantized",
    "scheme",
]
WORDS = [
    "default",
    "float32",
    "float16",
    "q4_1",
    "none",
    "paged",
    "inductor",
    "kiln.attention",
    "gate_proj",
    "silu",
    "num_tokens <= 2048",
    "seq_len <= 2048",
    "batch_size % 4 = 0",
    "seq_len // 0 == 1",
    "hidden_size == 576",
    "cuda:0",
    "sm_80",
    "int8",
    "num_tokens % 8 == 0",
]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.sampled_from(WORDS),
    st.text(max_size=12),
)
trees = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.sampled_from(KEYS), kids, max_size=5)),
    max_leaves=25,
)


def accepted_or_recipe_error(text: str) -> None:
    try:
        recipe = load_recipe_text(text)
    except RecipeError as exc:
        assert exc.diagnostics and all(d.severity in ("error", "warning", "info") for d in exc.diagnostics)
        assert any(d.severity == "error" for d in exc.diagnostics)
        return
    assert recipe.spec == RecipeSpec.model_validate(parse_source(text, "<string>").data)  # never a pruned spec


def migrated_or_recipe_error(text: str) -> None:
    """migrate gives recipe text (which validate then accepts or rejects with a RecipeError) or a RecipeError."""
    try:
        migration = migrate_text(text, "in.yaml")
    except RecipeError as exc:
        assert any(d.severity == "error" for d in exc.diagnostics)
        return
    assert isinstance(migration.text, str) and all(n.line >= 1 and n.message for n in migration.notes)
    accepted_or_recipe_error(migration.text)


def dump(data: object) -> str:
    out = io.StringIO()
    YAML(typ="rt").dump(data, out)
    return out.getvalue()


@SETTINGS
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    accepted_or_recipe_error(text)


@pytest.mark.filterwarnings("ignore::ruamel.yaml.error.ReusedAnchorWarning")
@SETTINGS
@given(
    st.lists(
        st.sampled_from(
            [
                "recipe_version: 1\n",
                "model: {name: m}\n",
                "model:\n  name: m\n",
                "- x\n",
                "  constraints: [seq_len <= 8]\n",
                "graph: {capture_sizes: [1, 2]}\n",
                "a: &a [1]\n",
                "b: *a\n",
                "c: *missing\n",
                "{",
                "]",
                "'",
                '"',
                "key: value: x\n",
                "\t",
                "---\n",
                "!!python/object:os.system x\n",
                "!custom 3\n",
                "? complex\n",
                "d: 2024-13-45\n",
                "<<: {x: 1}\n",
                "input_constraints:\n",
            ]
        ),
        max_size=8,
    ).map("".join)
)
def test_random_yaml_fragments(text: str) -> None:
    accepted_or_recipe_error(text)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), trees, max_size=6))
def test_random_recipe_shaped_data(data: dict) -> None:
    accepted_or_recipe_error(dump(data))


@SETTINGS
@given(st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=30)), min_size=1, max_size=4))
def test_random_constraints_in_a_valid_recipe(constraints: list[str]) -> None:
    data = {
        "recipe_version": 1,
        "model": {"name": "m", "path": "default"},
        "weights": {"dtype": "float32", "source_quantization": "q4_1"},
        "input_constraints": {"constraints": ["seq_len <= 2048", "num_tokens <= 64", *constraints]},
    }
    accepted_or_recipe_error(dump(data))


@SETTINGS
@given(st.text(max_size=200))
def test_migrate_random_text(text: str) -> None:
    migrated_or_recipe_error(text)


@pytest.mark.filterwarnings("ignore::ruamel.yaml.error.ReusedAnchorWarning")
@SETTINGS
@given(
    st.lists(
        st.sampled_from(
            [
                "model_name: m\n",
                "version: '1.0'\n",
                "hardware_preference: {gpu_arch: sm_80, power_limit_watts: 300}\n",
                "device_affinity: {device: 'cuda:0'}\n",
                "input_constraints:\n",
                "  input_ids: {shape: [batch_size, seq_len], constraints: [seq_len <= 8]}\n",
                "  hidden_states: {dtype: float16, constraints: &c [num_tokens % 8 == 0]}\n",
                "fusion_groups: [{name: g, ops: [silu], constraint: {all_ops_quantized: true}}]\n",
                "debug_mode: *c\n",
                "a: &a {gpu_arch: x}\n",
                "hardware_preference: *a\n",
                "<<: {model_name: y}\n",
                "# comment\n",
                "  # indented comment\n",
                "- x\n",
                "{",
                "key: value: x\n",
                "!custom 3\n",
            ]
        ),
        max_size=8,
    ).map("".join)
)
def test_migrate_random_yaml_fragments(text: str) -> None:
    migrated_or_recipe_error(text)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), trees, max_size=6))
def test_migrate_random_community_shaped_data(data: dict) -> None:
    migrated_or_recipe_error(dump(data))
