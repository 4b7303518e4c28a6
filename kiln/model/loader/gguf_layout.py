"""How a family's GGUF files are laid out (`GGUFLayout`, the `gguf` part of its entry in
kiln.model.loader.families): tensor names, value transforms, and what llama.cpp leaves out of the metadata.

Each layout follows llama.cpp's converter (convert_hf_to_gguf.py) as HF transformers' GGUF loader reads it
(transformers.modeling_gguf_pytorch_utils, the reference kiln's tests compare with):
- `layer_names`: `blk.N.<gguf>` -> `model.layers.N.<hf>`, the HF names the family's model class consumes;
- `implied`: the settings llama.cpp's converter leaves out of the family's files or fixes, under config.json's
  names, so that the one config reader reads a GGUF as it reads config.json (kiln.model.loader.config_view);
- `permuted_qk`: llama.cpp's Llama converter interleaves the q/k rows of each head (kiln undoes it); no other;
- `norm_plus_one`: Gemma's converter stores every `*norm.weight` as 1 + w (kiln's GemmaRMSNorm wants w);
- `experts`: the 3-D `ffn_{gate,up,down}_exps` stacks, loaded as one HF tensor per expert and projection, and
  (keys with `{j}`) the one-tensor-per-expert names of older converters;
- `long_rope`: Phi-3's long-rope factor tensors are read (kiln.model.loader.gguf_rope);
- `with_experts`: llama.cpp writes Mixtral as architecture "llama" with `llama.expert_count`: the layout of the
  files of its architecture that have experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.model.loader.base import ConfigFields
from kiln.model.loader.gguf_names import GLOBAL_NAMES, LAYER_NAMES, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS

# what a family's file says, under config.json's names (kiln.model.loader.config_view) -> what llama.cpp's converter
# leaves out of such files or fixes, by config.json's names (None: absent, whatever the file holds)
GGUFImplied = Callable[[ConfigFields], dict[str, object]]

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
class GGUFLayout:
    """How a family's GGUF files are laid out (the fields are described in the module docstring)."""

    architecture: str  # llama.cpp's name for it: the file's `general.architecture`
    layer_names: dict[str, str] = field(default_factory=lambda: LAYER_NAMES)
    implied: GGUFImplied | None = None
    permuted_qk: bool = False
    norm_plus_one: bool = False
    experts: dict[str, str] = field(default_factory=dict)  # `blk.N.<gguf>` -> HF name with `{j}` for the expert
    long_rope: bool = False
    # the files of `architecture` with experts (`{arch}.expert_count` > 0) are this family's: Mixtral's "llama"
    with_experts: bool = False

    def rope_tensors(self) -> tuple[str, ...]:
        """The rope factor tensors its files may hold: read into the rotary tables, not loaded as weights."""
        return (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT) if self.long_rope else (ROPE_FREQS,)


def _stored_or(stored: ConfigFields, key: str, default: object) -> object:
    value = stored.lookup(key)
    return default if value is None else value


def _gemma(stored: ConfigFields, layers_27b: int) -> dict[str, object]:
    layers = stored.positive_int("num_hidden_layers")
    hidden, heads = stored.positive_int("hidden_size"), stored.positive_int("num_attention_heads")
    head_dim = stored.head_dim()
    # NOTE: llama.cpp scales queries by head_dim**-0.5, except for the 27B models (told apart by their layer
    # count), where it is (hidden / heads)**-0.5: their configs' query_pre_attn_scalar; GGUF does not store it
    scalar = hidden // heads if layers == layers_27b else head_dim
    # NOTE: llama.cpp's Gemma files hold no layer kinds (the pattern is the family's) and mean a 4096-token window
    # where the key is absent; the head size is key_length, else hidden / heads (not HF's default of 256)
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": float(scalar),
        "sliding_window": _stored_or(stored, "sliding_window", 4096),
    }


def gemma2_implied(stored: ConfigFields) -> dict[str, object]:
    # NOTE: llama.cpp's soft-caps (HF Gemma 2's defaults too) where the file lacks the keys
    return _gemma(stored, layers_27b=46) | {
        "attn_logit_softcapping": _stored_or(stored, "attn_logit_softcapping", 50.0),
        "final_logit_softcapping": _stored_or(stored, "final_logit_softcapping", 30.0),
    }


def gemma3_implied(stored: ConfigFields) -> dict[str, object]:
    # NOTE: llama.cpp fixes the sliding layers' rotary base at 10000 and caps no logits
    return _gemma(stored, layers_27b=62) | {"rope_local_base_freq": 10000.0, "final_logit_softcapping": None}


def qwen3_moe_implied(stored: ConfigFields) -> dict[str, object]:
    # NOTE: Qwen3-MoE renormalizes the top-k weights (llama.cpp; transformers' GGUF default norm_topk_prob=True)
    return {"norm_topk_prob": True}


def mistral_implied(stored: ConfigFields) -> dict[str, object]:
    # NOTE: kiln has never read a window from these files (llama.cpp runs them as Llama, attending globally)
    return {"sliding_window": None}


@dataclass(frozen=True)
class HFTensor:
    """One HF-named tensor a GGUF tensor loads as: the whole of it, or expert `expert` of a 3-D stack."""

    name: str
    shape: tuple[int, ...]
    expert: int | None = None


def hf_tensors(family: GGUFLayout, name: str, shape: tuple[int, ...]) -> list[HFTensor]:
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


def gguf_name(family: GGUFLayout, hf_name: str) -> str:
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


def known_names(family: GGUFLayout) -> list[str]:
    """How messages list the tensor names a family's files may hold."""
    layer = ", ".join([*family.layer_names, *family.experts])
    return [*GLOBAL_NAMES, f"blk.N.{{{layer}}}"]
