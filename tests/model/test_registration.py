"""`kiln.models.register`: a made-up architecture (examples/parallel_lm.py, and one defined here) loads from its
own checkpoint names, matches a plain-PyTorch reference, runs in piecewise graph mode, and its graph breaks are
found by `kiln debug explain`; unknown architectures and broken plugins are clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from examples import parallel_lm
from kiln import LLM, SamplingParams, models
from kiln.debug.explain import explain_model
from kiln.errors import ConfigError, ModelLoadError
from kiln.model.attention import allocate_kv_caches
from kiln.model.loader import families as families_module
from kiln.model.loader import open_checkpoint
from tests.engine.tiny_models import default_tokenizer_json

SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3}
PROMPT = [5, 17, 42, 7, 99, 3, 61, 250, 11, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("parallel_lm")
    parallel_lm.write_checkpoint(directory, SMALL, default_tokenizer_json())
    return directory


def reference_logits(directory: Path, ids: list[int], double_norm: bool = False) -> torch.Tensor:
    """ParallelLM written out in plain PyTorch from the checkpoint's own tensor names (no kiln code);
    `double_norm`: each block first replaces its input by the normed input (`DoubleNormLM`)."""
    w = load_file(directory / "model.safetensors")
    c = json.loads((directory / "config.json").read_text())
    heads, kv_heads, n = c["num_attention_heads"], c["num_key_value_heads"], len(ids)
    d = c["hidden_size"] // heads

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]))

    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = torch.outer(torch.arange(n).float(), inv).repeat(1, 2)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [heads, n, d]
        rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
        return x * angles.cos() + rotated * angles.sin()

    h = w["transformer.wte.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        h = norm(h, w[p + "ln.weight"]) if double_norm else h
        x = norm(h, w[p + "ln.weight"])
        q, k, v = (x @ w[p + "attn.wqkv.weight"].T).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k, v = (t.view(n, -1, d).transpose(0, 1) for t in (q, k, v))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (k, v))
        attn = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True).transpose(0, 1).reshape(n, -1)
        gate, up = (x @ w[p + "ffn.w_in.weight"].T).chunk(2, dim=-1)
        h = h + attn @ w[p + "attn.wo.weight"].T + (F.silu(gate) * up) @ w[p + "ffn.w_out.weight"].T
    return norm(h, w["transformer.ln_f.weight"]) @ w["transformer.wte.weight"].T


def test_a_registered_architecture_matches_its_reference(checkpoint: Path) -> None:
    engine = LLM(str(checkpoint), num_kv_blocks=16, graph_mode="eager").engine
    assert type(engine.model).__name__ == "ParallelLMForCausalLM"
    assert engine.model.config.architecture == "parallel_lm" and engine.model.config.own.parallel_residual
    assert (prompt_logits(engine, PROMPT) - reference_logits(checkpoint, PROMPT)).abs().max().item() < 1e-4


def prompt_logits(engine: object, ids: list[int]) -> torch.Tensor:
    engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0))
    inputs = engine.runner.prepare(engine.scheduler.schedule())
    return engine.model.compute_logits(engine.runner.forward(inputs)[: len(ids)])


def test_a_registered_architecture_runs_piecewise_with_eager_tokens(checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0)
    eager = [
        o.token_ids
        for o in LLM(str(checkpoint), num_kv_blocks=16, graph_mode="eager").generate([PROMPT, PROMPT[:4]], params)
    ]
    graph = LLM(str(checkpoint), num_kv_blocks=16, graph_mode="piecewise", compiler="eager", capture_sizes=(1, 2))
    assert [o.token_ids for o in graph.generate([PROMPT, PROMPT[:4]], params)] == eager
    graph.engine.executor.counters.expect(pieces_seen=4, pieces_compiled=3)


class DoubleNormBlock(parallel_lm.Block):
    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, self.norm(hidden))


class DoubleNormLM(parallel_lm.ParallelLMForCausalLM):
    """A variant defined here: every block normalises its input twice."""

    def __init__(self, config: models.ModelConfig, max_positions: int, freq_factors: object = None) -> None:
        super().__init__(config, max_positions)
        rotary = self.model.rotary_emb
        self.model.layers = torch.nn.ModuleList(DoubleNormBlock(config, i, rotary) for i in range(config.num_layers))


def test_a_model_class_defined_here_registers_and_loads(checkpoint: Path, tmp_path: Path) -> None:
    models.register("DoubleNormLM", DoubleNormLM, read_config=parallel_lm.read_config)
    config = json.loads((checkpoint / "config.json").read_text()) | {"architectures": ["DoubleNormLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    (tmp_path / "tokenizer.json").symlink_to(checkpoint / "tokenizer.json")
    engine = LLM(str(tmp_path), num_kv_blocks=16, graph_mode="eager").engine
    assert type(engine.model) is DoubleNormLM and engine.model.config.architecture == "DoubleNormLM"
    got = prompt_logits(engine, PROMPT)
    assert (got - reference_logits(checkpoint, PROMPT, double_norm=True)).abs().max().item() < 1e-4
    assert (got - reference_logits(checkpoint, PROMPT)).abs().max().item() > 1e-2  # not ParallelLM's forward


def test_explain_finds_the_graph_break_of_the_draft(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text()) | {"architectures": [parallel_lm.DRAFT]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    ckpt = open_checkpoint(str(tmp_path))
    model = models.FAMILIES[parallel_lm.DRAFT].model_class()(ckpt.config, 64)
    model.load_weights(ckpt.weights())
    explanation = explain_model(model.eval(), allocate_kv_caches(ckpt.config, 2, 16, torch.float32, "cpu"), ())
    breaks = [f for f in explanation.findings if f.kind == "graph break"]
    assert breaks and breaks[0].module_path.startswith("model.layers.0")
    assert "parallel_lm.py" in breaks[0].location


def test_an_unknown_architecture_names_the_ways_to_register(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text()) | {"architectures": ["NobodysForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"kiln\.models\.register.*KILN_MODEL_PLUGINS"):
        open_checkpoint(str(tmp_path)).config  # noqa: B018


def test_a_broken_plugin_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(families_module.PLUGIN_ENV, "no_such_kiln_plugin")
    monkeypatch.setattr(families_module, "_plugins_loaded", False)
    with pytest.raises(ConfigError, match="cannot import model plugin 'no_such_kiln_plugin'"):
        families_module.load_plugins()


def test_a_kiln_architecture_key_cannot_be_taken() -> None:
    with pytest.raises(ConfigError, match="'llama' is LlamaForCausalLM's"):
        models.register("OtherForCausalLM", DoubleNormLM, architecture="llama")


def test_the_recipe_of_a_registered_architecture_validates_and_names_what_runs(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The example's recipe, checked against the registered family's header; its model.path is what runs."""
    from kiln.engine.setup.args import EngineArgs

    recipe = Path(parallel_lm.__file__).with_suffix(".yaml").read_text()
    (tmp_path / "parallel_lm.yaml").write_text(recipe)
    (tmp_path / "parallel-lm").symlink_to(checkpoint)
    config = EngineArgs(recipe=str(tmp_path / "parallel_lm.yaml")).create_engine_config()
    assert Path(config.model).resolve() == checkpoint.resolve()
    assert config.recipe is not None and config.recipe.model_values["num_layers"] == SMALL["num_hidden_layers"]


PLUGIN = """
from examples import parallel_lm
from kiln import models

CALLS = []


class EntryPointLM(parallel_lm.ParallelLMForCausalLM):
    pass


def register():
    CALLS.append("register")
    models.register("EntryPointLMForCausalLM", EntryPointLM, architecture="entry_point_lm",
                    read_config=parallel_lm.read_config)
"""


def test_a_kiln_models_entry_point_is_found_when_a_checkpoint_names_its_architecture(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed package's `kiln.models` entry point (here a dist-info on sys.path, as pip writes one) is
    discovered when a checkpoint names an architecture kiln does not know, its function called once, and the
    model it registers loads and computes ParallelLM's logits."""
    site = tmp_path / "site"
    (site / "kiln_entry_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "kiln_entry_plugin.py").write_text(PLUGIN)
    info = site / "kiln_entry_plugin-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-entry-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kiln.models]\nentry_point_lm = kiln_entry_plugin:register\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(families_module.PLUGIN_ENV, raising=False)
    monkeypatch.setattr(families_module, "_plugins_loaded", False)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = json.loads((checkpoint / "config.json").read_text()) | {"architectures": ["EntryPointLMForCausalLM"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).symlink_to(checkpoint / name)
    assert "EntryPointLMForCausalLM" not in models.FAMILIES
    try:
        engine = LLM(str(model_dir), num_kv_blocks=16, graph_mode="eager").engine
        plugin = sys.modules["kiln_entry_plugin"]
        assert plugin.CALLS == ["register"]
        assert type(engine.model) is plugin.EntryPointLM
        got = prompt_logits(engine, PROMPT)
        assert (got - reference_logits(checkpoint, PROMPT)).abs().max().item() < 1e-4
    finally:
        models.FAMILIES.pop("EntryPointLMForCausalLM", None)
        sys.modules.pop("kiln_entry_plugin", None)
