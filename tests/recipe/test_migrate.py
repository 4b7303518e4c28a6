"""`kiln recipe migrate`: community-shaped recipes become kiln recipes that validate, comments kept, and every
field left behind is a note with its line and the reason."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

from kiln.recipe import RecipeError, load_recipe, load_recipe_text
from kiln.recipe.cli import main
from kiln.recipe.migrate import migrate_text
from kiln.recipe.source import parse_source

COMMUNITY = Path(__file__).resolve().parents[2] / "recipes" / "community"
KILN_RECIPE = COMMUNITY.parent / "smollm2-135m.yaml"


def migrate(name: str, out: str | None = None):
    path = COMMUNITY / name
    return migrate_text(path.read_text(), str(path), out)


def notes_of(migration) -> list[tuple[int, int, str]]:
    return [(n.line, n.col, n.message) for n in migration.notes]


def test_cpu_example_migrates_to_a_recipe_that_validates(tmp_path) -> None:
    out = tmp_path / "smollm2-cpu.yaml"
    migration = migrate("cpu.yaml", str(out))
    out.write_text(migration.text)
    recipe = load_recipe(str(out))
    assert [d.format() for d in recipe.diagnostics if d.severity == "error"] == []
    assert (recipe.max_num_batched_tokens, recipe.max_num_seqs, recipe.max_model_len) == (2048, 64, 2048)
    assert recipe.spec.model.name == "smollm2-135m-instruct"
    assert recipe.spec.hardware.memory_budget_gb == 8  # memory_pool_config.pool_size_gb
    assert [g.name for g in recipe.fusion_groups] == ["mlp"]
    assert "    - num_tokens <= 2048  # tokens in one forward\n" in migration.text
    assert "  name: smollm2-135m-instruct  # the bundled model\n" in migration.text
    assert notes_of(migration) == [
        (
            14,
            3,
            "input_ids not carried: kiln's input_ids is [num_tokens], not [batch_size, seq_len]; "
            "its constraints are carried",
        ),
        (25, 23, "memory_bandwidth_optimized not carried: kiln chooses kernels by timing them"),
    ]


def test_full_example_notes_every_field_it_does_not_carry() -> None:
    migration = migrate("full.yaml")
    assert [(line, col, message.split(":")[0]) for line, col, message in notes_of(migration)] == [
        (12, 3, "input_ids not carried"),
        (20, 68, "all_ops_quantized not carried (group mlp)"),
        (27, 3, "memory_bandwidth_optimized not carried"),
        (28, 3, "power_limit_watts not carried"),
        (29, 40, "allocator not carried"),
        (29, 60, "enable_defragmentation not carried"),
        (30, 19, "device index 'cuda"),
        (30, 37, "numa_node not carried"),
    ]
    assert (28, 3, "power_limit_watts not carried: kiln does not manage device power") in notes_of(migration)
    assert "  arch: sm_80  # A100 or newer\n" in migration.text
    assert "  debug_mode: false  # true logs every graph piece\n" in migration.text


def test_full_example_fails_only_on_the_hardware_it_asks_for() -> None:
    """full.yaml asks for a CUDA device with sm_80: on a machine without one, that is its only error."""
    text = migrate("full.yaml").text
    lines = text.splitlines()
    hardware = {i + 1 for i, line in enumerate(lines) if line.lstrip().startswith(("device:", "arch:"))}
    try:
        recipe = load_recipe_text(text, "full-migrated.yaml")
    except RecipeError as exc:
        errors = [d for d in exc.diagnostics if d.severity == "error"]
        assert errors and {d.line for d in errors} <= hardware, [d.format() for d in errors]
        return
    assert recipe.spec.hardware.device == "cuda" and recipe.spec.hardware.arch == "sm_80"


def test_full_example_values_land_in_kiln_places() -> None:
    data = parse_source(migrate("full.yaml").text, "m.yaml").data
    assert data["recipe_version"] == 1
    assert data["model"] == {"name": "smollm2-135m", "layer_type": "decoder"}
    assert data["input_constraints"]["constraints"] == ["num_tokens % 8 == 0", "batch_size % 4 == 0", "seq_len <= 2048"]
    assert "input_ids" not in data["input_constraints"]
    assert data["fusion_groups"] == [{"name": "mlp", "ops": ["gate_proj", "up_proj", "silu", "mul"]}]
    assert data["memory_plan"] == {"kv_cache": {"dtype": "float16", "layout": "paged", "max_pages": 1024}}
    assert data["hardware"] == {"device": "cuda", "arch": "sm_80", "memory_budget_gb": 16}
    assert data["debug"] == {"debug_mode": False}
    assert data["weights"] == {"dtype": "float32", "source_quantization": "q4_1"}
    assert data["graph"]["capture_sizes"] == [8, 16, 32]  # the defaults that num_tokens % 8 == 0 allows


def test_a_kiln_recipe_migrates_to_the_same_recipe(tmp_path) -> None:
    migration = migrate_text(KILN_RECIPE.read_text(), str(KILN_RECIPE))
    assert migration.notes == []
    original = load_recipe(str(KILN_RECIPE))
    assert load_recipe_text(migration.text, str(tmp_path / "m.yaml")).hash == original.hash
    assert migrate_text(migration.text, "m.yaml").text == migration.text  # and again: nothing changes


def test_all_ops_quantized_is_carried_when_quantization_is_set() -> None:
    text = textwrap.dedent("""\
        model_name: m
        quantization: {scheme: int8}
        fusion_groups:
          - {name: mlp, ops: [gate_proj], constraint: {all_ops_quantized: true, max_latency_us: 5}}
        """)
    migration = migrate_text(text, "q.yaml")
    assert notes_of(migration) == [
        (4, 73, "max_latency_us not carried: kiln fusion groups carry no conditions (group mlp)")
    ]
    assert "quantization: {weights: int8}" in migration.text
    assert "all_ops_quantized: int8" in migration.text  # the claim, made checkable: the scheme the group runs


def test_a_field_set_twice_and_unknown_keys_are_notes() -> None:
    text = textwrap.dedent("""\
        model_name: m
        hardware_preference: {device: cpu, gpu_arhc: sm_80}
        device_affinity: {device: cuda}
        frobnicate: 3
        """)
    assert notes_of(migrate_text(text, "t.yaml")) == [
        (2, 36, "gpu_arhc not carried: kiln has no 'gpu_arhc' in hardware"),
        (3, 19, "device not carried: hardware.device is already set (line 2)"),
        (4, 1, "frobnicate not carried: kiln has no 'frobnicate' at the top level"),
    ]


def test_capture_sizes_follow_the_num_tokens_constraints() -> None:
    text = 'model_name: m\ninput_constraints: {constraints: ["num_tokens % 64 == 0", "seq_len <= 64"]}\n'
    data = parse_source(migrate_text(text).text, "m.yaml").data
    assert data["graph"]["capture_sizes"] == [64, 128, 256, 512, 1024, 2048]


def test_relative_model_path_is_rewritten_for_the_output(tmp_path) -> None:
    from kiln.model.loader import default_model_path

    model = default_model_path()
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    source = tmp_path / "in" / "r.yaml"
    relative = os.path.relpath(model, source.parent)
    source.write_text((COMMUNITY / "cpu.yaml").read_text() + f'model_path: "{relative}"\n')
    out = tmp_path / "out" / "r.yaml"
    assert main(["migrate", str(source), "--out", str(out)]) == 0
    assert load_recipe(str(out)).model_path == model


def test_cli_prints_to_stdout_and_notes_to_stderr(capsys) -> None:
    path = str(COMMUNITY / "full.yaml")
    assert main(["migrate", path]) == 0
    captured = capsys.readouterr()
    assert captured.out == migrate("full.yaml").text
    assert f"{path}:28:3: note: power_limit_watts not carried: kiln does not manage device power" in captured.err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# only a comment\n", "the recipe has only comments; expected a mapping with recipe_version, model, ..."),
        ("- a\n", "a recipe must be a YAML mapping (recipe_version, model, ...), found a CommentedSeq"),
    ],
)
def test_input_that_is_no_mapping_fails_with_exit_1(tmp_path, capsys, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        migrate_text(text, str(path))
    assert [d.message for d in info.value.diagnostics] == [message]
    assert main(["migrate", str(path)]) == 1
    assert f"bad.yaml:1:1: error: {message}" in capsys.readouterr().err
    assert main(["migrate", str(tmp_path / "absent.yaml")]) == 2


PIECEWISE_RECIPE = """\
# a recipe written before graph.mode  (the header stays)
recipe_version: 1
model: {{name: smollm2}}
weights: {{dtype: float32, source_quantization: q4_1}}
input_constraints:
  constraints: [num_tokens <= 2048, seq_len <= 2048]
graph:
  piecewise: {piecewise}  # the old switch
  capture_sizes: [1, 2, 4]   # sizes captured
hardware: {{device: cpu}}
"""


@pytest.mark.parametrize(("piecewise", "mode"), [("true", "full_and_piecewise"), ("false", "full")])
def test_migrate_rewrites_piecewise_as_the_mode_it_meant(tmp_path, piecewise: str, mode: str) -> None:
    """The retired key is refused with the migrate hint; migrate rewrites it in place (comments, order and the
    other keys as written), and the result validates with the mode the old schema read from it."""
    path = tmp_path / "old.yaml"
    path.write_text(PIECEWISE_RECIPE.format(piecewise=piecewise))
    with pytest.raises(RecipeError, match=f"run `kiln recipe migrate {path} --out {path}`"):
        load_recipe(str(path))
    assert main(["migrate", str(path), "--out", str(path)]) == 0
    text = path.read_text()
    expected = PIECEWISE_RECIPE.format(piecewise=piecewise).replace(f"piecewise: {piecewise}", f"mode: {mode}")
    assert re.sub(" +#", " #", text) == re.sub(" +#", " #", expected)  # NOTE: a comment keeps its column
    assert "# the old switch" in text and text.startswith("# a recipe written before graph.mode")
    assert load_recipe(str(path)).graph_mode == mode
    assert migrate_text(text, str(path)).notes == []  # and again: nothing left to rewrite


def test_migrate_keeps_a_mode_given_beside_piecewise() -> None:
    text = PIECEWISE_RECIPE.format(piecewise="false").replace("  capture_sizes", "  mode: piecewise\n  capture_sizes")
    migration = migrate_text(text, "r.yaml")
    assert notes_of(migration) == [(8, 3, "graph.piecewise dropped: graph.mode piecewise says which graphs run")]
    assert "piecewise: false" not in migration.text and "  mode: piecewise\n" in migration.text
    assert load_recipe_text(migration.text, "r.yaml").graph_mode == "piecewise"
