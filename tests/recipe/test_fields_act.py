"""Every recipe field acts or is refused (issue 53, item 6). The fields are enumerated from the schema
(kiln.recipe.schema.RecipeSpec: its sections, theirs, and lists of them), so a field added later fails the walk until
it is classified here. Each field either sets what the engine is built from (the EngineConfig the recipe resolves to,
its hash aside, or the recipe's bounds and constraints), or is a check (a value that contradicts the checkpoint, the
machine or the one value kiln supports is refused, naming the field). A field written where it would do nothing is
refused naming it and why, and a flag and the recipe field of the same setting are refused by the same rule, in the
same words. Configs only: no model is loaded (the recipe reads the checkpoint's header)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml

from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError
from kiln.model.loader import open_checkpoint
from kiln.recipe import RecipeError, load_recipe
from kiln.recipe.machine import this_machine
from kiln.recipe.schema import RecipeSpec, Section

BASE: dict[str, Any] = {
    "recipe_version": 1,
    "model": {"name": "smollm2-135m-instruct"},
    "weights": {"source_quantization": "q4_1"},
    "input_constraints": {"constraints": ["seq_len <= 1024", "num_tokens <= 32"]},
    "graph": {"mode": "piecewise", "capture_sizes": [1, 2, 4]},
    "hardware": {"device": "cpu"},
}
LAYERS = [f"decoder_layer_{i}" for i in range(30)]  # the default model's
PACKED = {"quantization": {"weights": "int4"}}
MLP = {"name": "mlp", "ops": ["gate_proj", "up_proj", "silu", "mul"], "required": False}
NGRAM = {"speculative": {"method": "ngram"}}
OTHER_ARCH = "aarch64" if this_machine().machine == "x86_64" else "x86_64"  # an ISA this machine lacks
TWO_STAGES = [{"device_id": 0, "kernel_groups": LAYERS[:15]}, {"device_id": 1, "kernel_groups": LAYERS[15:]}]
OTHER_CHECKPOINT = "OTHER_CHECKPOINT"  # replaced by another path to the default checkpoint


@dataclass(frozen=True)
class Sets:
    """Written over `context`, the field changes what the engine is built from."""

    change: dict[str, Any]
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Checks:
    """The field is checked: `wrong` is refused with an error containing `message`."""

    wrong: dict[str, Any]
    message: str


ACTS: dict[str, Sets | Checks] = {
    "recipe_version": Checks({"recipe_version": 2}, "recipe_version: expected 1, got 2"),
    "model.name": Checks({"model": {"name": "qwen2-7b"}}, "model.name 'qwen2-7b' does not match the checkpoint"),
    "model.path": Sets({"model": {"path": OTHER_CHECKPOINT}}),
    "model.layer_type": Checks({"model": {"layer_type": "encoder"}}, "model.layer_type: expected 'decoder'"),
    "model.architecture": Checks({"model": {"architecture": "qwen2"}}, "model.architecture 'qwen2' does not match"),
    "model.num_experts": Checks({"model": {"num_experts": 8}}, "model.num_experts is 8, but the checkpoint has no"),
    "model.top_k": Checks({"model": {"top_k": 2}}, "model.top_k is 2, but the checkpoint has no"),
    "input_constraints.input_ids.shape": Checks(
        {"input_constraints": {"input_ids": {"shape": ["num_tokens", 2], "dtype": "int64"}}},
        "input_ids.shape has 2 dimensions, expected 1",
    ),
    "input_constraints.input_ids.dtype": Checks(
        {"input_constraints": {"input_ids": {"shape": ["num_tokens"], "dtype": "float32"}}},
        "input_ids.dtype is float32",
    ),
    "input_constraints.positions.shape": Checks(
        {"input_constraints": {"positions": {"shape": [], "dtype": "int64"}}},
        "positions.shape has 0 dimensions, expected 1",
    ),
    "input_constraints.positions.dtype": Checks(
        {"input_constraints": {"positions": {"shape": ["num_tokens"], "dtype": "int32"}}},
        "positions.dtype: int32 is not supported",
    ),
    "input_constraints.hidden_states.shape": Checks(
        {"input_constraints": {"hidden_states": {"shape": ["num_tokens", 512], "dtype": "float32"}}},
        "hidden_states.shape[1]: found 512 but the model's hidden_size is 576",
    ),
    "input_constraints.hidden_states.dtype": Checks(
        {"input_constraints": {"hidden_states": {"shape": ["num_tokens", "hidden_size"], "dtype": "bfloat16"}}},
        "hidden_states.dtype is bfloat16, expected float32",
    ),
    "input_constraints.constraints": Sets(
        {"input_constraints": {"constraints": ["seq_len <= 512", "num_tokens <= 8"]}}
    ),
    "weights.dtype": Sets({"weights": {"dtype": "bfloat16"}}),
    "weights.source_quantization": Checks(
        {"weights": {"source_quantization": "q8_0"}}, "weights.source_quantization: q8_0, but"
    ),
    "quantization.weights": Sets(PACKED),
    "quantization.group_size": Sets({"quantization": {"group_size": 64}}, {"quantization": {"weights": "int8"}}),
    "quantization.activations": Sets({"quantization": {"activations": "int8"}}, PACKED),
    "fusion_groups[].name": Sets({"fusion_groups": [{**MLP, "name": "mlp2"}]}, {"fusion_groups": [MLP]}),
    "fusion_groups[].ops": Sets(
        {"fusion_groups": [{**MLP, "ops": ["gate_proj", "up_proj"]}]}, {"fusion_groups": [MLP]}
    ),
    "fusion_groups[].required": Sets({"fusion_groups": [{**MLP, "required": True}]}, {"fusion_groups": [MLP]}),
    "fusion_groups[].all_ops_quantized": Sets(
        {"fusion_groups": [{**MLP, "all_ops_quantized": "int4"}]}, {"fusion_groups": [MLP], **PACKED}
    ),
    "memory_plan.kv_cache.dtype": Sets({"memory_plan": {"kv_cache": {"dtype": "bfloat16"}}}),
    "memory_plan.kv_cache.layout": Checks(
        {"memory_plan": {"kv_cache": {"layout": "contiguous"}}}, "layout: contiguous is not supported"
    ),
    "memory_plan.kv_cache.block_size": Sets({"memory_plan": {"kv_cache": {"block_size": 32}}}),
    "memory_plan.kv_cache.max_pages": Sets({"memory_plan": {"kv_cache": {"max_pages": 512}}}),
    "memory_plan.kv_cache.prefix_caching": Sets({"memory_plan": {"kv_cache": {"prefix_caching": False}}}),
    "memory_plan.activation_reuse": Checks(
        {"memory_plan": {"activation_reuse": False}}, "activation_reuse: false is not supported"
    ),
    "memory_plan.second_form_memory_gb": Sets({"memory_plan": {"second_form_memory_gb": 1.0}}, PACKED),
    "graph.mode": Sets({"graph": {"mode": "full_and_piecewise"}}),
    "graph.splitting_ops": Sets({"graph": {"splitting_ops": ["kiln::attention"]}}),
    "graph.capture_sizes": Sets({"graph": {"capture_sizes": [1, 2]}}),
    "graph.compile_sizes": Sets({"graph": {"compile_sizes": [1]}}),
    "graph.compiler": Sets({"graph": {"compiler": "eager"}}),
    "speculative.method": Sets(NGRAM),
    "speculative.num_speculative_tokens": Sets({"speculative": {"num_speculative_tokens": 2}}, NGRAM),
    "speculative.prompt_lookup_max": Sets({"speculative": {"prompt_lookup_max": 3}}, NGRAM),
    "speculative.prompt_lookup_min": Sets({"speculative": {"prompt_lookup_min": 1}}, NGRAM),
    "speculative.policy": Sets({"speculative": {"policy": "always"}}, NGRAM),
    "speculative.draft_model": Sets(
        {"speculative": {"draft_model": OTHER_CHECKPOINT}},
        {"speculative": {"method": "draft", "draft_model": "default"}},
    ),
    "lora.max_loras": Sets({"lora": {"max_loras": 2}}, {"lora": {}}),
    "lora.max_rank": Sets({"lora": {"max_rank": 8}}, {"lora": {}}),
    "lora.target_modules": Sets({"lora": {"target_modules": ["q_proj"]}}, {"lora": {}}),
    "lora.dtype": Sets({"lora": {"dtype": "bfloat16"}}, {"lora": {}}),
    "hardware.device": Checks({"hardware": {"device": "cuda"}}, "this recipe asks for cuda"),
    "hardware.arch": Checks(
        {"hardware": {"arch": OTHER_ARCH}},
        "this CPU does not have it",
    ),
    "hardware.memory_budget_gb": Checks({"hardware": {"memory_budget_gb": 0.01}}, "memory_budget_gb 0.01 is too small"),
    "parallel.tensor": Sets({"parallel": {"tensor": 3}}),
    "parallel.pipeline": Sets({"parallel": {"pipeline": 2}}),
    "device_affinity[].device_id": Checks(
        {"device_affinity": [{**TWO_STAGES[0], "device_id": 1}, {**TWO_STAGES[1], "device_id": 0}]},
        "stages run in device_id order",
    ),
    "device_affinity[].kernel_groups": Sets(
        {
            "device_affinity": [
                {"device_id": 0, "kernel_groups": LAYERS[:10]},
                {"device_id": 1, "kernel_groups": LAYERS[10:]},
            ]
        },
        {"device_affinity": TWO_STAGES},
    ),
    "debug.debug_mode": Sets({"debug": {"debug_mode": True}}),
}


def _section_in(annotation: Any) -> tuple[type[Section], bool] | None:
    """The section a field holds and whether it holds a list of them; None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, False
    for arg in get_args(annotation):
        if found := _section_in(arg):
            return found[0], found[1] or get_origin(annotation) is list
    return None


def recipe_fields(section: type[Section] = RecipeSpec, prefix: str = "") -> list[str]:
    """Every field a recipe may write, as a dotted path (`[]` after a list of sections)."""
    paths = []
    for name, info in section.model_fields.items():
        found = _section_in(info.annotation)
        if found is None:
            paths.append(prefix + name)
        else:
            paths += recipe_fields(found[0], f"{prefix}{name}{'[].' if found[1] else '.'}")
    return paths


def merged(base: dict[str, Any], *overlays: dict[str, Any]) -> dict[str, Any]:
    """`base` with each overlay written over it: sections merge, values (lists included) replace."""
    out = dict(base)
    for overlay in overlays:
        for key, value in overlay.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merged(out[key], value) if both else value
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the walk writes its recipes, and a second path to the default checkpoint (OTHER_CHECKPOINT)."""
    path = tmp_path_factory.mktemp("walk")
    checkpoint = Path(open_checkpoint("default").path)
    (path / "other").mkdir()
    (path / "other" / checkpoint.name).symlink_to(checkpoint)
    return path


def write(folder: Path, recipe: dict[str, Any]) -> Path:
    other = str(next((folder / "other").iterdir()))
    text = yaml.safe_dump(recipe, sort_keys=False).replace(OTHER_CHECKPOINT, other)
    path = folder / "walk.yaml"  # one path: a group's `where` and the recipe's path are the same in every probe
    path.write_text(text)
    return path


@functools.cache
def _resolved(text: str, path: str) -> tuple[Any, ...]:
    config = resolve_engine_config(EngineArgs(recipe=path))
    recipe = config.recipe
    assert recipe is not None
    groups = tuple(replace(g, where="") for g in config.graph.fusion_groups)  # its line moves with the text above it
    graph = replace(config.graph, recipe_hash="", fusion_groups=groups)
    constraints = tuple(c.expr.normalized for c in recipe.constraints)
    return replace(config, graph=graph), tuple(sorted(recipe.bounds.items())), constraints


def built(folder: Path, recipe: dict[str, Any]) -> tuple[Any, ...]:
    """What the engine is built from under `recipe`: its EngineConfig (the recipe's hash aside: every value changes
    it), the recipe's bounds and its constraints (checked on every request and step)."""
    path = write(folder, recipe)
    return _resolved(path.read_text(), str(path))


def refusal(folder: Path, recipe: dict[str, Any]) -> str:
    """The errors `recipe` is refused with, one a line."""
    with pytest.raises(RecipeError) as refused:
        load_recipe(str(write(folder, recipe)))
    return "\n".join(d.message for d in refused.value.diagnostics if d.severity == "error")


def test_the_walk_names_every_recipe_field() -> None:
    assert sorted(ACTS) == sorted(recipe_fields())
    assert "graph.compiler" in recipe_fields() and "fusion_groups[].required" in recipe_fields()


@pytest.mark.parametrize("name", sorted(ACTS))
def test_every_recipe_field_sets_what_is_built_or_is_checked(name: str, folder: Path) -> None:
    probe = ACTS[name]
    if name == "hardware.device" and this_machine().cuda is not None:  # a GPU machine runs it: it sets the device
        assert built(folder, merged(BASE, probe.wrong))[0].device == "cuda"
        return
    if isinstance(probe, Sets):
        assert built(folder, merged(BASE, probe.context, probe.change)) != built(folder, merged(BASE, probe.context))
        return
    assert probe.message in refusal(folder, merged(BASE, probe.wrong))


PLAIN = {key: value for key, value in BASE.items() if key != "graph"}
INERT: dict[str, tuple[dict[str, Any], str]] = {
    "capture sizes under eager": (
        {"graph": {"mode": "eager", "capture_sizes": [1, 2]}},
        "graph.capture_sizes does nothing under graph.mode eager",
    ),
    "compile sizes under eager": (
        {"graph": {"mode": "eager", "compile_sizes": [1]}},
        "graph.compile_sizes does nothing under graph.mode eager",
    ),
    "the compiler under eager": (
        {"graph": {"mode": "eager", "compiler": "eager"}},
        "graph.compiler does nothing under graph.mode eager",
    ),
    "split points where nothing is split": (
        {"graph": {"mode": "full", "splitting_ops": ["kiln.attention"]}},
        "graph.splitting_ops does nothing under graph.mode full",
    ),
    "debug tracing under eager": (
        {"graph": {"mode": "eager"}, "debug": {"debug_mode": True}},
        "debug.debug_mode traces graph-mode pieces, but graph.mode is eager",
    ),
    "a required fusion group under eager": (
        {"graph": {"mode": "eager"}, "fusion_groups": [{**MLP, "required": True}]},
        "fusion group mlp cannot be realised: graph.mode is eager",
    ),
    "second forms without quantized weights": (
        {"memory_plan": {"second_form_memory_gb": 1.0}},
        "memory_plan.second_form_memory_gb does nothing without packed or quantized weights",
    ),
    "a group size without quantized weights": (
        {"quantization": {"group_size": 64}},
        "quantization.group_size does nothing without quantized weights",
    ),
    "activations without quantized weights": (
        {"quantization": {"activations": "int8"}},
        "quantization.activations does nothing without quantized weights",
    ),
    "draft tokens without a method": (
        {"speculative": {"num_speculative_tokens": 2}},
        "speculative.num_speculative_tokens does nothing without speculative.method",
    ),
    "a policy without a method": (
        {"speculative": {"policy": "always"}},
        "speculative.policy does nothing without speculative.method",
    ),
    "lookup beside a draft model": (
        {"speculative": {"method": "draft", "draft_model": "default", "prompt_lookup_max": 3}},
        "speculative.prompt_lookup_max tunes the ngram method only, not draft",
    ),
    "a draft model without the draft method": (
        {"speculative": {"method": "ngram", "draft_model": "default"}},
        "a draft model (default) is only used by the draft method, not by ngram",
    ),
}


@pytest.mark.parametrize("case", sorted(INERT))
def test_a_field_that_would_do_nothing_is_refused_by_name(case: str, folder: Path) -> None:
    change, named = INERT[case]
    assert named in refusal(folder, merged(PLAIN, change))


# the same setting as flags (EngineArgs) and as recipe fields, and the reason both refusals give
ONE_RULE: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "the compiler under eager": (
        {"graph_mode": "eager", "compiler": "eager"},
        {"graph": {"mode": "eager", "compiler": "eager"}},
        "does nothing under graph",
    ),
    "capture sizes under eager": (
        {"graph_mode": "eager", "capture_sizes": (1, 2)},
        {"graph": {"mode": "eager", "capture_sizes": [1, 2]}},
        "(no piece is traced)",
    ),
    "compile sizes under eager": (
        {"graph_mode": "eager", "compile_sizes": (1,)},
        {"graph": {"mode": "eager", "compile_sizes": [1]}},
        "(no piece is traced)",
    ),
    "draft tokens without a method": (
        {"num_speculative_tokens": 2},
        {"speculative": {"num_speculative_tokens": 2}},
        "(speculation is off)",
    ),
    "lookup without a method": (
        {"prompt_lookup_max": 3},
        {"speculative": {"prompt_lookup_max": 3}},
        "(speculation is off)",
    ),
    "a policy without a method": (
        {"speculative_policy": "always"},
        {"speculative": {"policy": "always"}},
        "(speculation is off)",
    ),
    "lookup beside a draft model": (
        {"speculative_method": "draft", "speculative_model": "default", "prompt_lookup_min": 1},
        {"speculative": {"method": "draft", "draft_model": "default", "prompt_lookup_min": 1}},
        "tunes the ngram method only, not draft",
    ),
    "a group size without quantized weights": (
        {"quantization": "none", "quantization_group_size": 64},
        {"quantization": {"group_size": 64}},
        "it sizes the groups of weights kiln quantizes at load",
    ),
    "activations without quantized weights": (
        {"quantization": "none", "activations": "int8"},
        {"quantization": {"activations": "int8"}},
        "does nothing without quantized weights",
    ),
    "second forms without quantized weights": (
        {"quantization": "none", "second_form_memory_gb": 1.0},
        {"memory_plan": {"second_form_memory_gb": 1.0}},
        "does nothing without packed or quantized weights on the CPU",
    ),
}


@pytest.mark.parametrize("case", sorted(ONE_RULE))
def test_a_flag_and_its_recipe_field_are_refused_by_one_rule(case: str, folder: Path) -> None:
    options, change, why = ONE_RULE[case]
    with pytest.raises(ConfigError) as flag_refused:
        resolve_engine_config(EngineArgs(**options))
    recipe_refused = refusal(folder, merged(PLAIN, change))
    assert why in str(flag_refused.value) and why in recipe_refused


def test_float32_activations_are_accepted_anywhere_as_the_flag(folder: Path) -> None:
    """What unquantized weights run with anyway: a script or a recipe may state it for every model."""
    assert resolve_engine_config(EngineArgs(quantization="none", activations="float32")).activations == "float32"
    assert built(folder, merged(PLAIN, {"quantization": {"activations": "float32"}}))[0].activations == "float32"


def test_the_probe_sees_no_change_in_a_default_written_out(folder: Path) -> None:
    """The walk's comparison can fail: fields written at their defaults build the same engine."""
    defaults = {"graph": {"compiler": "inductor"}, "memory_plan": {"kv_cache": {"block_size": 16}}, "debug": {}}
    assert built(folder, merged(BASE, defaults)) == built(folder, BASE)
