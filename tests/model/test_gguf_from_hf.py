"""GGUF files transformers' GGUF loader cannot read, converted from tiny random HF models as llama.cpp's
convert_hf_to_gguf.py converts them: Mixtral (architecture "llama" with `llama.expert_count`) and Phi-3 with
long-rope factors. The reference is the HF model itself, holding the weights the file holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kiln import LLM
from kiln.errors import ModelLoadError
from kiln.model.layers import RotaryEmbedding
from kiln.model.loader import open_checkpoint
from tests.engine.parity import kiln_batch_logits
from tests.engine.tiny_models import rewrite_safetensors, write_hf_model
from tests.model.test_gguf_families import PROMPTS, write_gguf

# llama.cpp's names (gguf-py's tensor_mapping) of the HF tensors these families hold, after `model.layers.N.`
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPERT = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}  # Mixtral's expert projections
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=4)
ORIGINAL, LONGEST = 16, 64  # Phi-3's pretraining and extended context: every prompt fits the pretraining one
LONG_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1 + i / 8 for i in range(8)],
    "long_factor": [2 + i / 4 for i in range(8)],
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotate-half rows interleaved into rotary pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_gguf(state: dict[str, torch.Tensor], heads: tuple[int, int] | None, stacked: bool) -> dict[str, np.ndarray]:
    """HF checkpoint tensors -> llama.cpp's: renamed, q/k rows permuted (`heads`: query and key/value heads), each
    expert projection stacked into `ffn_*_exps`, or one `ffn_*.{j}` tensor per expert as older converters wrote."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name in GLOBAL:
            out[GLOBAL[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.startswith("block_sparse_moe.experts."):
            j, proj = rest.split(".")[2:4]
            if stacked:
                stacks.setdefault(f"blk.{layer}.{EXPERT[proj]}_exps.weight", {})[int(j)] = w
            else:
                out[f"blk.{layer}.{EXPERT[proj]}.{j}.weight"] = w
            continue
        if heads is not None and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            w = _permute(w, heads[rest.startswith("self_attn.k")])
        out[f"blk.{layer}.{LAYER[rest]}"] = w
    return out | {name: np.stack([ws[j] for j in sorted(ws)]) for name, ws in stacks.items()}


def _settings(config: Any) -> dict[str, Any]:
    return {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "vocab_size": config.vocab_size,
    }


def _round_trip(state: dict[str, torch.Tensor], tensor_type: str) -> None:
    """Every matrix but the routers rounded through `tensor_type`, as the GGUF will hold it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[tensor_type]
    for name, t in state.items():
        if t.ndim == 2 and ".gate." not in name and qtype != GGMLQuantizationType.F32:
            state[name] = torch.from_numpy(dequantize(quantize(t.float().numpy(), qtype), qtype).reshape(t.shape))


def _mixtral(
    tmp_path: Path, stacked: bool, tensor_type: str, edit: Callable[[dict[str, np.ndarray]], object] | None = None
) -> tuple[Path, torch.nn.Module]:
    """A Mixtral GGUF converted from a tiny HF Mixtral (the HF model returned holds the file's weights); `edit`
    may change the GGUF's tensors before they are written."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "hf"
    config = write_hf_model(hf_dir, "mixtral", perturb=0.05, **MIXTRAL).config
    state = load_file(str(rewrite_safetensors(hf_dir, lambda s: _round_trip(s, tensor_type))))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    settings = _settings(config) | {"expert_count": 4, "expert_used_count": 2, "attention.sliding_window": 4}
    path = tmp_path / "mixtral.gguf"
    tensors = _to_gguf(state, (config.num_attention_heads, config.num_key_value_heads), stacked)
    if edit is not None:
        edit(tensors)
    write_gguf(path, "llama", settings, tensors, tensor_type, keep_f32=("ffn_gate_inp",))
    return path, hf


@pytest.mark.parametrize("stacked,tensor_type", [(True, "F32"), (True, "Q8_0"), (False, "F32")])
def test_mixtral_gguf_matches_transformers_mixtral(tmp_path: Path, stacked: bool, tensor_type: str) -> None:
    """A "llama" file with llama.expert_count is Mixtral: softmax top-2 routing renormalized, a sliding window;
    its experts stacked in 3-D tensors or one tensor each."""
    path, hf = _mixtral(tmp_path, stacked, tensor_type)
    config = open_checkpoint(str(path)).config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("mixtral", 4, 2)
    assert config.moe is not None and (config.moe.intermediate_size, config.moe.norm_topk_prob) == (32, True)
    assert config.sliding_window == 4
    got = kiln_batch_logits(str(path), PROMPTS)
    with torch.no_grad():
        for ids, logits in zip(PROMPTS, got, strict=True):
            assert (logits - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4


def _cut_expert(tensors: dict[str, np.ndarray]) -> None:
    tensors["blk.1.ffn_down.3.weight"] = tensors["blk.1.ffn_down.3.weight"][:, :16]


def test_a_misshapen_expert_tensor_is_named_as_the_file_names_it(tmp_path: Path) -> None:
    path, _ = _mixtral(tmp_path, stacked=False, tensor_type="F32", edit=_cut_expert)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.1\.ffn_down\.3\.weight: .*\(64, 16\)"):
        LLM(str(path), num_kv_blocks=32, graph_mode="eager")


def _phi3(tmp_path: Path, rope: dict[str, Any], more: dict[str, Any]) -> tuple[Path, torch.nn.Module]:
    """A Phi-3 GGUF converted from a tiny HF Phi-3 with long-rope `rope`; `more`: extra `phi3.*` metadata."""
    from safetensors.torch import load_file

    hf_dir = tmp_path / "hf"
    overrides = dict(max_position_embeddings=LONGEST, original_max_position_embeddings=ORIGINAL, rope_scaling=rope)
    hf = write_hf_model(hf_dir, "phi3", perturb=0.05, pad_token_id=0, **overrides)
    (shard,) = hf_dir.glob("*.safetensors")
    tensors = _to_gguf(load_file(str(shard)), None, stacked=True)
    for kind in ("long", "short"):
        tensors[f"rope_factors_{kind}.weight"] = np.array(rope[f"{kind}_factor"], dtype=np.float32)
    settings = _settings(hf.config) | {"rope.scaling.original_context_length": ORIGINAL} | more
    path = tmp_path / "phi3.gguf"
    write_gguf(path, "phi3", settings, tensors, "F32")
    return path, hf


@pytest.mark.parametrize("attn_factor", [None, 1.25])
def test_phi3_long_rope_gguf_matches_transformers_phi3(tmp_path: Path, attn_factor: float | None) -> None:
    """rope_factors_long/short and the context lengths read as HF's longrope config: the prompts (within the
    pretraining context) run the short factors, as HF's do; past it kiln's rotary tables take the long factors, as
    HF's do once a sequence outgrows it. Without rope.scaling.attn_factor the magnitude is computed as HF does."""
    rope = LONG_ROPE | ({} if attn_factor is None else {"attention_factor": attn_factor})
    more = {} if attn_factor is None else {"rope.scaling.attn_factor": attn_factor}
    path, hf = _phi3(tmp_path, rope, more)
    config = open_checkpoint(str(path)).config
    assert config.rope_scaling == open_checkpoint(str(tmp_path / "hf")).config.rope_scaling
    assert config.max_position_embeddings == LONGEST
    got = kiln_batch_logits(str(path), PROMPTS)
    with torch.no_grad():
        for ids, logits in zip(PROMPTS, got, strict=True):
            assert (logits - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4
        short = hf.model.rotary_emb(torch.zeros(1), torch.arange(ORIGINAL)[None])
        long = hf.model.rotary_emb(torch.zeros(1), torch.arange(LONGEST)[None])
    table = RotaryEmbedding(config, LONGEST)
    for kiln_table, short_table, long_table in zip((table.cos_cache, table.sin_cache), short, long, strict=True):
        assert torch.allclose(kiln_table[:ORIGINAL], short_table[0], atol=1e-5)
        assert torch.allclose(kiln_table[ORIGINAL:], long_table[0, ORIGINAL:], atol=1e-5)
    assert not torch.allclose(long[0][0, :ORIGINAL], short[0][0], atol=1e-2)  # the two factors tell apart


def _bad_phi3(tmp_path: Path, tensors: dict[str, np.ndarray | None], settings: dict[str, Any]) -> Path:
    """A Phi-3 file (head_dim 16: 8 rope factors) with long-rope `tensors` (None: left out) and `settings` changed."""
    base = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4}
    base |= {"vocab_size": 256, "context_length": LONGEST, "rope.scaling.original_context_length": ORIGINAL}
    factors = {
        "rope_factors_long.weight": np.full(8, 2.0, np.float32),
        "rope_factors_short.weight": np.ones(8, np.float32),
    }
    factors = {k: v for k, v in (factors | tensors).items() if v is not None}
    path = tmp_path / "phi3.gguf"
    write_gguf(path, "phi3", {k: v for k, v in (base | settings).items() if v is not None}, factors, "F32")
    return path


@pytest.mark.parametrize(
    "tensors,settings,message",
    [
        (
            {"rope_factors_long.weight": np.ones(4, np.float32)},
            {},
            r"rope_factors_long\.weight has shape \(4,\), expected \(8,\)",
        ),
        (
            {"rope_factors_short.weight": None},
            {},
            r"has no tensor rope_factors_short\.weight: Phi-3's long-rope needs both",
        ),
        (
            {"rope_factors_short.weight": np.zeros(8, np.float32)},
            {},
            "rope_factors_short.weight must hold positive factors",
        ),
        (
            {},
            {"rope.scaling.original_context_length": None},
            r"field phi3\.rope\.scaling\.original_context_length is missing",
        ),
        ({}, {"rope.scaling.attn_factor": 0.0}, r"field phi3\.rope\.scaling\.attn_factor must be a positive number"),
    ],
)
def test_long_rope_kiln_cannot_read_is_refused(
    tmp_path: Path, tensors: dict[str, np.ndarray | None], settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        open_checkpoint(str(_bad_phi3(tmp_path, tensors, settings))).config  # noqa: B018


def test_long_rope_factors_outside_phi3_are_unknown_tensors(tmp_path: Path) -> None:
    """llama.cpp reads rope_factors_* for Phi-3 only: in a llama file they are tensors kiln does not know."""
    from tests.engine.tiny_models import write_gguf_model

    path = tmp_path / "llama.gguf"
    write_gguf_model(path, tensor_shapes={"rope_factors_long.weight": (8,), "rope_factors_short.weight": (8,)})
    assert open_checkpoint(str(path)).config.rope_scaling is None
    with pytest.raises(ModelLoadError, match=r"unknown tensor rope_factors_long\.weight and 1 more"):
        open_checkpoint(str(path)).weight_shapes()
