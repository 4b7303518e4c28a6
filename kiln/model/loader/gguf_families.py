"""The GGUF architectures kiln loads: llama.cpp's `general.architecture` -> kiln family, tensor names, config.

Each entry follows llama.cpp's converter (convert_hf_to_gguf.py) as HF transformers' GGUF loader reads it
(transformers.modeling_gguf_pytorch_utils, the reference kiln's tests compare with):
- `layer_names`: `blk.N.<gguf>` -> `model.layers.N.<hf>`, the HF names the family's model class consumes;
- `permuted_qk`: llama.cpp's Llama converter interleaves the q/k rows of each head (kiln undoes it); no other;
- `norm_plus_one`: Gemma's converter stores every `*norm.weight` as 1 + w (kiln's GemmaRMSNorm wants w);
- `experts`: the 3-D `ffn_{gate,up,down}_exps` stacks, loaded as one HF tensor per expert and projection, and
  (keys with `{j}`) the one-tensor-per-expert names of older converters;
- `read_config`: the family's `ModelConfig` fields beyond the shared ones, from `{arch}.*` metadata;
- `long_rope`: Phi-3's long-rope factor tensors are read (kiln.model.loader.gguf_rope).

llama.cpp writes Mixtral as architecture "llama" with `llama.expert_count`: `family_of` tells the two apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.model.loader.base import ConfigFields
from kiln.model.loader.gguf_names import GLOBAL_NAMES, LAYER_NAMES, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS

# (the family's metadata under `{arch}.`, the shared ModelConfig fields already read, the file's tensor names)
# -> the family's own ModelConfig fields
GGUFConfigReader = Callable[[ConfigFields, dict[str, Any], set[str]], dict[str, Any]]

QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
PHI3_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if not k.startswith(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"))},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate rows then up rows, as HF's Phi-3 stores them
}
GEMMA_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
MOE_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# NOTE: the per-expert names of kiln.model.moe.CHECKPOINT_NAMES for the Qwen MoE families (spelled out here so that
# reading a header imports no model code)
QWEN_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{j}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{j}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{j}.down_proj.weight",
}
MIXTRAL_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
# NOTE: kiln.model.moe.CHECKPOINT_NAMES["mixtral"]: w1 the gate, w3 the up and w2 the down projection. Converters
# before llama.cpp's 3-D expert tensors (spring 2024) wrote one tensor per expert, `ffn_gate.{j}.weight` etc.
MIXTRAL_EXPERT_NAMES = {
    f"{gguf}{layout}.weight": f"block_sparse_moe.experts.{{j}}.{hf}.weight"
    for layout in ("_exps", ".{j}")
    for gguf, hf in (("ffn_gate", "w1"), ("ffn_up", "w3"), ("ffn_down", "w2"))
}


@dataclass(frozen=True)
class GGUFFamily:
    """How kiln loads one llama.cpp architecture (the fields are described in the module docstring)."""

    architecture: str  # kiln's family key (ModelConfig.architecture, kiln.model.loader.families)
    layer_names: dict[str, str] = field(default_factory=lambda: LAYER_NAMES)
    read_config: GGUFConfigReader | None = None
    permuted_qk: bool = False
    norm_plus_one: bool = False
    experts: dict[str, str] = field(default_factory=dict)  # `blk.N.<gguf>` -> HF name with `{j}` for the expert
    long_rope: bool = False

    def read_own(self, fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
        return {} if self.read_config is None else self.read_config(fields, shared, tensors)

    def rope_tensors(self) -> tuple[str, ...]:
        """The rope factor tensors its files may hold: read into the rotary tables, not loaded as weights."""
        return (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT) if self.long_rope else (ROPE_FREQS,)


def _sliding(fields: ConfigFields, default: int | None = None) -> dict[str, Any]:
    """Every layer slides when `attention.sliding_window` is set (llama.cpp's n_swa)."""
    key = "attention.sliding_window"
    if fields.lookup(key) is None and default is None:
        return {}
    return {"sliding_window": fields.positive_int(key, default)}


def read_qwen3(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    return {"extra": {"qk_norm": True}}


def read_phi3(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    # NOTE: long-rope is rope scaling, read with the shared fields (kiln.model.loader.gguf_rope)
    return {"extra": {"fused_checkpoint": True}, **_sliding(fields)}


def _gemma(fields: ConfigFields, shared: dict[str, Any], pattern: int, layers_27b: int) -> dict[str, Any]:
    layers = shared["num_layers"]
    kinds = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    # NOTE: llama.cpp scales queries by head_dim**-0.5, except for the 27B models (told apart by their layer
    # count), where it is (hidden / heads)**-0.5: their configs' query_pre_attn_scalar; GGUF does not store it
    is_27b = layers == layers_27b
    scalar = shared["hidden_size"] // shared["num_heads"] if is_27b else shared["head_dim"]
    return {
        "hidden_act": "gelu_tanh",
        "rms_norm_eps": fields.positive_float("attention.layer_norm_rms_epsilon", 1e-6),
        "layer_types": kinds,
        "extra": {"query_pre_attn_scalar": float(scalar)},
    }


def read_gemma2(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    out = _gemma(fields, shared, pattern=2, layers_27b=46)
    # NOTE: llama.cpp's defaults (HF Gemma 2's too) where the file lacks the keys
    out["extra"]["attn_logit_softcapping"] = fields.positive_float("attn_logit_softcapping", 50.0)
    out["extra"]["final_logit_softcapping"] = fields.positive_float("final_logit_softcapping", 30.0)
    return {**out, **_sliding(fields, 4096)}


def read_gemma3(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    out = _gemma(fields, shared, pattern=6, layers_27b=62)
    # NOTE: llama.cpp fixes the sliding layers' rotary base at 10000; freq_base is the global layers'
    out["extra"] |= {"qk_norm": True, "rope_local_base_freq": 10000.0, "final_logit_softcapping": 0.0}
    return {**out, "rope_theta": fields.positive_float("rope.freq_base", 1e6), **_sliding(fields, 4096)}


def _moe(fields: ConfigFields, naming: str, norm_topk_prob: bool, width: int | None = None) -> dict[str, Any]:
    """The expert counts and widths (`width`, else `expert_feed_forward_length`) of an MoE family."""
    experts = fields.positive_int("expert_count")
    top_k = fields.positive_int("expert_used_count")
    if top_k > experts:
        raise fields.error("expert_used_count", f"is {top_k}, more than the {experts} experts (expert_count)")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width or fields.positive_int("expert_feed_forward_length"),
        "extra": {"moe_naming": naming, "norm_topk_prob": norm_topk_prob},
    }


def read_mixtral(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    # NOTE: llama.cpp's Llama graph gives every expert feed_forward_length (it ignores expert_feed_forward_length)
    # and renormalizes the top-k softmax weights, as HF's Mixtral does
    out = _moe(fields, "mixtral", norm_topk_prob=True, width=shared["intermediate_size"])
    return {**out, **_sliding(fields)}


def read_qwen2_moe(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    # NOTE: Qwen2-MoE leaves the top-k weights as the softmax gave them (llama.cpp, HF's default)
    out = _moe(fields, "qwen2_moe", norm_topk_prob=False)
    out["extra"]["shared_expert_intermediate_size"] = fields.positive_int("expert_shared_feed_forward_length")
    return out


def read_qwen3_moe(fields: ConfigFields, shared: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    # NOTE: Qwen3-MoE renormalizes the top-k weights (llama.cpp; transformers' GGUF default norm_topk_prob=True)
    out = _moe(fields, "qwen3_moe", norm_topk_prob=True)
    out["extra"]["qk_norm"] = True
    return out


# llama.cpp's `general.architecture` -> how kiln loads it
GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", permuted_qk=True),
    "mistral": GGUFFamily("mistral", permuted_qk=True),
    "qwen2": GGUFFamily("qwen2"),
    "qwen3": GGUFFamily("qwen3", LAYER_NAMES | QK_NORM_NAMES, read_qwen3),
    "phi3": GGUFFamily("phi3", PHI3_NAMES, read_phi3, long_rope=True),
    "gemma2": GGUFFamily("gemma2", GEMMA_NAMES, read_gemma2, norm_plus_one=True),
    "gemma3": GGUFFamily("gemma3", GEMMA_NAMES | QK_NORM_NAMES, read_gemma3, norm_plus_one=True),
    "qwen2moe": GGUFFamily("qwen2_moe", MOE_NAMES | SHARED_EXPERT_NAMES, read_qwen2_moe, experts=QWEN_EXPERT_NAMES),
    "qwen3moe": GGUFFamily("qwen3_moe", MOE_NAMES | QK_NORM_NAMES, read_qwen3_moe, experts=QWEN_EXPERT_NAMES),
}
# llama.cpp's `general.architecture` -> the family its files with experts (`{arch}.expert_count` > 0) hold
MOE_VARIANTS: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("mixtral", MIXTRAL_NAMES, read_mixtral, permuted_qk=True, experts=MIXTRAL_EXPERT_NAMES),
}


def family_of(architecture: str, lookup: Callable[[str], object]) -> GGUFFamily:
    """How kiln loads a file of a supported llama.cpp `architecture` whose metadata is `lookup(key)`."""
    variant = MOE_VARIANTS.get(architecture)
    # NOTE: llama.cpp builds dense MLPs when expert_count is 0 or absent (the variant's reader checks its type)
    if variant is None or not lookup(f"{architecture}.expert_count"):
        return GGUF_FAMILIES[architecture]
    return variant


def kiln_family(architecture: str) -> GGUFFamily:
    """The GGUF naming of kiln family `architecture` (ModelConfig.architecture; Llama's for a family GGUF lacks)."""
    families = [*GGUF_FAMILIES.values(), *MOE_VARIANTS.values()]
    return next((f for f in families if f.architecture == architecture), GGUF_FAMILIES["llama"])


@dataclass(frozen=True)
class HFTensor:
    """One HF-named tensor a GGUF tensor loads as: the whole of it, or expert `expert` of a 3-D stack."""

    name: str
    shape: tuple[int, ...]
    expert: int | None = None


def hf_tensors(family: GGUFFamily, name: str, shape: tuple[int, ...]) -> list[HFTensor]:
    """The HF tensors GGUF tensor `name` (logical `shape`, outermost first) loads as; [] when it has none."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.experts and len(shape) == 3:
        pattern = f"model.layers.{parts[1]}.{family.experts[parts[2]]}"
        return [HFTensor(pattern.format(j=j), shape[1:], j) for j in range(shape[0])]
    stem, _, rest = parts[-1].partition(".")
    expert, _, suffix = rest.partition(".")  # one expert's tensor: `ffn_gate.{j}.weight`
    one_expert = family.experts.get(f"{stem}.{{j}}.{suffix}") if expert.isdigit() else None
    if len(parts) == 3 and parts[0] == "blk" and one_expert is not None:
        return [HFTensor(f"model.layers.{parts[1]}.{one_expert.format(j=int(expert))}", shape)]
    if name in GLOBAL_NAMES:
        return [HFTensor(GLOBAL_NAMES[name], shape)]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.layer_names:
        if parts[2] == "ffn_gate_inp_shexp.weight" and len(shape) == 1:
            shape = (1, *shape)  # NOTE: llama.cpp stores the shared expert's gate [hidden]; HF's is [1, hidden]
        return [HFTensor(f"model.layers.{parts[1]}.{family.layer_names[parts[2]]}", shape)]
    return []


def gguf_name(family: GGUFFamily, hf_name: str) -> str:
    """The GGUF name of an HF-named tensor in a family's files, for messages (the name itself when none); an expert's
    tensor by its stack, the newer of Mixtral's two layouts (GGUFCheckpoint.tensor_label names a file's own)."""
    globals_to_gguf = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}
    if hf_name in globals_to_gguf:
        return globals_to_gguf[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return hf_name
    layer, rest = parts[2], parts[3]
    found = next((gguf for gguf, hf in family.layer_names.items() if hf == rest), None)
    if found is not None:
        return f"blk.{layer}.{found}"
    for gguf, pattern in family.experts.items():
        head, _, tail = pattern.partition("{j}")
        expert = rest.removeprefix(head).removesuffix(tail)
        if rest.startswith(head) and rest.endswith(tail) and expert.isdigit():
            return f"blk.{layer}.{gguf} (expert {expert})"
    return hf_name


def known_names(family: GGUFFamily) -> list[str]:
    """How messages list the tensor names a family's files may hold."""
    layer = ", ".join([*family.layer_names, *family.experts])
    return [*GLOBAL_NAMES, f"blk.N.{{{layer}}}"]
