"""One config reader for both formats: a family's HF config.json and a GGUF file of the same model (metadata as
llama.cpp's converter writes it, tensors named as tests/model/test_gguf_families.py writes them) give equal typed
settings; one `Family` entry answers to both of its names; an unknown architecture and a missing required field
are errors that name them, each in the file's own terms."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln import models
from kiln.config import ModelConfig, MoEConfig
from kiln.errors import ConfigError, ModelLoadError
from kiln.model.loader import open_checkpoint
from kiln.model.loader.families import FAMILIES, family_of, gguf_architectures, gguf_family
from kiln.model.loader.hf_config import parse_config
from tests.engine.tiny_models import write_gguf_model
from tests.model import test_gguf_families as gguf_fixtures
from tests.model.test_gguf_families import FF, MLP, NORMS, _attention, _experts, write_family_gguf

EPS = float(np.float32(1e-6))  # GGUF stores float32: the HF side states the same number
# what config.json says of the models test_gguf_families.FAMILIES writes: 2 layers, 4 heads, 2 KV heads, a toy
# tokenizer of 256 tokens whose last is the eos
HF_BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": FF,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": EPS,
    "eos_token_id": 255,
    "tie_word_embeddings": False,
}
GEMMA = {"head_dim": 256, "sliding_window": 4, "query_pre_attn_scalar": 256, "tie_word_embeddings": True}
QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2}
# family -> its config.json beyond HF_BASE (llama.cpp's conventions stated: Gemma 2's caps, Qwen3-MoE's top-k norm)
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "mistral": {"architectures": ["MistralForCausalLM"]},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},  # HF's Qwen2 always has q/k/v biases
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128},
    "phi3": {"architectures": ["Phi3ForCausalLM"]},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], **GEMMA}
    | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], **GEMMA, "rope_theta": 1e6, "num_hidden_layers": 6},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], **QWEN_MOE}
    | {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], **QWEN_MOE}
    | {"moe_intermediate_size": 768, "head_dim": 16, "norm_topk_prob": True},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    | {"sliding_window": 4},
}
# the GGUF files test_gguf_families.FAMILIES lacks: (arch, metadata, layer tensors, tied)
MORE_GGUF = {
    "llama": ("llama", {}, NORMS | _attention(16) | MLP, False),
    "mistral": ("mistral", {}, NORMS | _attention(16) | MLP, False),
    "mixtral": (
        "llama",
        {"expert_count": 4, "expert_used_count": 2, "attention.sliding_window": 4},
        NORMS | _attention(16) | _experts(4, FF),
        False,
    ),
}


def read_both(tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelConfig, ModelConfig]:
    """(config.json's ModelConfig, the GGUF's) of the same tiny `family` model, named alike."""
    for name, spec in MORE_GGUF.items():
        monkeypatch.setitem(gguf_fixtures.FAMILIES, name, spec)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, family, "F32")
    from_gguf = open_checkpoint(str(path)).config
    from_hf = parse_config(tmp_path / "config.json", HF_BASE | HF_CONFIGS[family])
    return from_hf, replace(from_gguf, name=from_hf.name)


@pytest.mark.parametrize("family", HF_CONFIGS)
def test_hf_and_gguf_give_equal_typed_settings(tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from_hf, from_gguf = read_both(tmp_path, family, monkeypatch)
    assert from_hf.architecture == family
    assert from_hf == from_gguf


def test_the_typed_parts_are_the_families(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the equal settings hold: each family's own parts, read from either file."""
    gemma2, _ = read_both(tmp_path / "g2", "gemma2", monkeypatch)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.query_pre_attn_scalar) == (
        50.0,
        30.0,
        256.0,
    )
    assert [gemma2.layer_window(i) for i in range(2)] == [4, 0] and not gemma2.qk_norm
    gemma3, _ = read_both(tmp_path / "g3", "gemma3", monkeypatch)
    assert gemma3.qk_norm and gemma3.final_logit_softcapping == 0.0
    assert (gemma3.rope_theta, gemma3.rope_local_base_freq) == (1e6, 1e4)
    qwen2_moe, _ = read_both(tmp_path / "q2", "qwen2_moe", monkeypatch)
    assert qwen2_moe.attention_bias and qwen2_moe.moe == MoEConfig(
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=1408,
        naming="qwen2_moe",
        norm_topk_prob=False,
        shared_expert_intermediate_size=5632,
    )
    mixtral, _ = read_both(tmp_path / "mx", "mixtral", monkeypatch)
    assert mixtral.moe is not None and (mixtral.moe.naming, mixtral.moe.intermediate_size) == ("mixtral", FF)
    phi3, _ = read_both(tmp_path / "p3", "phi3", monkeypatch)
    assert phi3.fused_checkpoint and phi3.moe is None


def test_one_family_entry_answers_to_both_names() -> None:
    for hf_name, family in FAMILIES.items():
        if family.gguf is None:
            continue
        found = gguf_family(family.gguf.architecture, has_experts=family.gguf.with_experts)
        assert found is not None and found[0] is family, hf_name
    assert family_of("mixtral").gguf is not None and family_of("mixtral").gguf.architecture == "llama"
    found = gguf_family("llama", has_experts=False)
    assert found is not None and found[0].architecture == "llama"  # a "llama" file without experts is Llama


def test_an_unknown_architecture_names_itself_and_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    write_gguf_model(path, arch="bert")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'bert': kiln runs gemma2, gemma3, llama"):
        open_checkpoint(str(path)).config  # noqa: B018
    assert "qwen3moe" in gguf_architectures()
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['BertForMaskedLM'\]: kiln runs Llama"):
        parse_config(tmp_path / "config.json", HF_BASE | {"architectures": ["BertForMaskedLM"]})
    with pytest.raises(ConfigError, match=r"no model family 'bert' is registered: kiln runs gemma2, gemma3, llama"):
        family_of("bert")


def test_a_missing_required_field_is_named_as_the_file_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same reader asks for Qwen2-MoE's shared expert width: config.json's key, or the GGUF's metadata key."""
    monkeypatch.setitem(
        gguf_fixtures.FAMILIES,
        "qwen2_moe",
        ("qwen2moe", {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 1408}, NORMS, False),
    )
    write_family_gguf(tmp_path / "moe.gguf", "qwen2_moe", "F32")
    with pytest.raises(ModelLoadError, match=r"field qwen2moe\.expert_shared_feed_forward_length is missing"):
        open_checkpoint(str(tmp_path / "moe.gguf")).config  # noqa: B018
    config = HF_BASE | HF_CONFIGS["qwen2_moe"]
    del config["shared_expert_intermediate_size"]
    with pytest.raises(ModelLoadError, match=r"field shared_expert_intermediate_size is missing \(expected a pos"):
        parse_config(tmp_path / "config.json", config)
    config = HF_BASE | HF_CONFIGS["gemma2"]
    del config["sliding_window"]
    with pytest.raises(ModelLoadError, match=r"field sliding_window is missing"):
        parse_config(tmp_path / "config.json", config)


def test_a_reader_that_returns_no_config_is_one_clear_error(tmp_path: Path) -> None:
    """A plugin written for the old reader shape (a dict of fields) is told what a reader returns."""
    models.register("DictReaderLM", "kiln.model.llama:LlamaForCausalLM", read_config=lambda view, config: {})
    try:
        with pytest.raises(ConfigError, match=r"returned dict: a reader returns the ModelConfig it was given"):
            parse_config(tmp_path / "config.json", HF_BASE | {"architectures": ["DictReaderLM"]})
    finally:
        FAMILIES.pop("DictReaderLM")
