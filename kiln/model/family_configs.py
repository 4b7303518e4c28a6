"""Config readers of the Llama-shaped families (kiln.model.loader.families): each reads what its family has beyond
the shared settings through a `ConfigView` (HF config.json and GGUF metadata alike, under config.json's names) into
the typed fields of a copy of the shared `ModelConfig`; a bad value is a ModelLoadError naming the file and the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kiln.config import ModelConfig, MoEConfig
from kiln.model.loader.base import ConfigFields
from kiln.model.loader.config_view import ConfigView

LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_fields(fields: ConfigFields, enabled: bool = True) -> dict[str, Any]:
    """`sliding_window` and, when the file lists them, `layer_types` (absent: every layer slides)."""
    if not enabled or fields.lookup("sliding_window") is None:
        return {}
    num_layers = fields.positive_int("num_hidden_layers")
    types = fields.choices("layer_types", num_layers, LAYER_TYPES)
    if not types and fields.lookup("max_window_layers") is not None:  # Qwen2 before layer_types: the top layers
        first = fields.positive_int("max_window_layers")
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    return {"sliding_window": fields.positive_int("sliding_window"), "layer_types": types}


def _qwen_sliding(fields: ConfigFields) -> dict[str, Any]:
    # NOTE: Qwen configs carry a sliding_window value that applies only with use_sliding_window
    return sliding_fields(fields, fields.flag("use_sliding_window", False))


def read_mistral(view: ConfigView, config: ModelConfig) -> ModelConfig:
    return replace(config, **sliding_fields(view))


def read_qwen2(view: ConfigView, config: ModelConfig) -> ModelConfig:
    return replace(config, **_qwen_sliding(view))


def read_qwen3(view: ConfigView, config: ModelConfig) -> ModelConfig:
    return replace(config, qk_norm=True, **_qwen_sliding(view))


def read_phi3(view: ConfigView, config: ModelConfig) -> ModelConfig:
    # NOTE: Phi-3 checkpoints store qkv_proj and gate_up_proj already fused; long-rope is read with the rope
    return replace(config, fused_checkpoint=True, **sliding_fields(view))


def _experts(
    fields: ConfigFields, experts_key: str, width_key: str, naming: str, norm_topk_prob: bool, **layout: Any
) -> MoEConfig:
    if fields.lookup(experts_key) is None and fields.lookup("num_local_experts") is not None:
        experts_key = "num_local_experts"  # transformers 5 writes Qwen MoE's num_experts under Mixtral's name
    experts = fields.positive_int(experts_key)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > experts:
        raise fields.error(
            "num_experts_per_tok", f"is {top_k}, more than the {experts} experts ({fields.name(experts_key)})"
        )
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        intermediate_size=fields.positive_int(width_key),
        naming=naming,
        norm_topk_prob=norm_topk_prob,
        **layout,
    )


def read_mixtral(view: ConfigView, config: ModelConfig) -> ModelConfig:
    # NOTE: every expert is intermediate_size wide, and the top-k softmax weights are renormalized
    moe = _experts(view, "num_local_experts", "intermediate_size", "mixtral", norm_topk_prob=True)
    return replace(config, moe=moe, **sliding_fields(view))


def _qwen_moe(view: ConfigView, naming: str, shared_expert: bool) -> MoEConfig:
    num_layers = view.positive_int("num_hidden_layers")
    dense = view.int_list("mlp_only_layers", len(view.lookup("mlp_only_layers") or ()))
    if any(i >= num_layers for i in dense):
        raise view.error("mlp_only_layers", f"names a layer past the {num_layers} layers")
    return _experts(
        view,
        "num_experts",
        "moe_intermediate_size",
        naming,
        # NOTE: Qwen2-MoE leaves the top-k weights as the softmax gave them (HF's default)
        norm_topk_prob=view.flag("norm_topk_prob", False),
        decoder_sparse_step=view.positive_int("decoder_sparse_step", 1),
        mlp_only_layers=dense,
        shared_expert_intermediate_size=view.positive_int("shared_expert_intermediate_size") if shared_expert else 0,
    )


def read_qwen2_moe(view: ConfigView, config: ModelConfig) -> ModelConfig:
    moe = _qwen_moe(view, "qwen2_moe", shared_expert=True)
    return replace(config, moe=moe, **_qwen_sliding(view))


def read_qwen3_moe(view: ConfigView, config: ModelConfig) -> ModelConfig:
    moe = _qwen_moe(view, "qwen3_moe", shared_expert=False)
    return replace(config, moe=moe, qk_norm=True, **_qwen_sliding(view))
