"""Config readers of the Llama-shaped families (kiln.model.loader.families): each returns the `ModelConfig`
fields its family sets beyond the shared ones, read from config.json with types checked (a bad value is a
ModelLoadError naming the file and the field)."""

from __future__ import annotations

from typing import Any

from kiln.model.loader.base import ConfigFields

LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_fields(fields: ConfigFields, enabled: bool = True) -> dict[str, Any]:
    """`sliding_window` and, when config.json lists them, `layer_types` (absent: every layer slides)."""
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


def read_mistral(fields: ConfigFields) -> dict[str, Any]:
    return sliding_fields(fields)


def read_qwen2(fields: ConfigFields) -> dict[str, Any]:
    return {"attention_bias": True, **_qwen_sliding(fields)}


def read_qwen3(fields: ConfigFields) -> dict[str, Any]:
    return {"attention_bias": fields.flag("attention_bias", False), "extra": {"qk_norm": True}, **_qwen_sliding(fields)}


def read_phi3(fields: ConfigFields) -> dict[str, Any]:
    # NOTE: Phi-3 checkpoints store qkv_proj and gate_up_proj already fused; long-rope is read by the rope reader
    return {"extra": {"fused_checkpoint": True}, **sliding_fields(fields)}


def _experts(fields: ConfigFields, experts_key: str, width_key: str) -> dict[str, Any]:
    if fields.lookup(experts_key) is None and fields.lookup("num_local_experts") is not None:
        experts_key = "num_local_experts"  # transformers 5 writes Qwen MoE's num_experts under Mixtral's name
    experts = fields.positive_int(experts_key)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > experts:
        raise fields.error("num_experts_per_tok", f"is {top_k}, more than the {experts} experts ({experts_key})")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": fields.positive_int(width_key),
    }


def read_mixtral(fields: ConfigFields) -> dict[str, Any]:
    extra = {"moe_naming": "mixtral", "norm_topk_prob": True}
    return {**_experts(fields, "num_local_experts", "intermediate_size"), "extra": extra, **sliding_fields(fields)}


def _qwen_moe(fields: ConfigFields, naming: str) -> dict[str, Any]:
    num_layers = fields.positive_int("num_hidden_layers")
    extra: dict[str, Any] = {
        "moe_naming": naming,
        "norm_topk_prob": fields.flag("norm_topk_prob", False),
        "decoder_sparse_step": fields.positive_int("decoder_sparse_step", 1),
        "mlp_only_layers": fields.int_list("mlp_only_layers", len(fields.lookup("mlp_only_layers") or ())),
    }
    if any(i >= num_layers for i in extra["mlp_only_layers"]):
        raise fields.error("mlp_only_layers", f"names a layer past the {num_layers} layers")
    return {**_experts(fields, "num_experts", "moe_intermediate_size"), "extra": extra, **_qwen_sliding(fields)}


def read_qwen2_moe(fields: ConfigFields) -> dict[str, Any]:
    out = _qwen_moe(fields, "qwen2_moe")
    out["extra"]["shared_expert_intermediate_size"] = fields.positive_int("shared_expert_intermediate_size")
    return {**out, "attention_bias": True}


def read_qwen3_moe(fields: ConfigFields) -> dict[str, Any]:
    out = _qwen_moe(fields, "qwen3_moe")
    out["extra"]["qk_norm"] = True
    return {**out, "attention_bias": fields.flag("attention_bias", False)}
