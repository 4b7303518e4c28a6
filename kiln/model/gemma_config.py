"""Config readers of Gemma 2 and Gemma 3 (text) (kiln.model.loader.families), through a `ConfigView` as every
family's: what sets them apart from the Llama shape, into the typed fields of a copy of the shared `ModelConfig`
(kiln.model.gemma describes what the model does with each)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kiln.config import ModelConfig
from kiln.model.family_configs import sliding_fields
from kiln.model.loader.base import ConfigFields
from kiln.model.loader.config_view import ConfigView


def read_gemma2(view: ConfigView, config: ModelConfig) -> ModelConfig:
    """Gemma 2: sliding and global layers alternate (sliding first) unless `layer_types` says otherwise."""
    own = _gemma_fields(view, default_pattern=2)
    return replace(config, attn_logit_softcapping=_optional_cap(view, "attn_logit_softcapping"), **own)


def read_gemma3(view: ConfigView, config: ModelConfig) -> ModelConfig:
    """Gemma 3 (text): q/k norms, five sliding layers to a global one by default, a rotary base per layer kind."""
    # NOTE: HF's Gemma 3 attention never passes attn_logit_softcapping on, so kiln ignores it too
    own = _gemma_fields(view, default_pattern=view.positive_int("sliding_window_pattern", 6))
    theta, scaling, local = view.rope_by_layer_kind(default_theta=1e6, default_local=1e4)
    return replace(config, qk_norm=True, rope_theta=theta, rope_scaling=scaling, rope_local_base_freq=local, **own)


def _gemma_fields(fields: ConfigFields, default_pattern: int) -> dict[str, Any]:
    if fields.lookup("use_bidirectional_attention"):
        raise fields.error("use_bidirectional_attention", "is true: kiln runs causal decoders only")
    num_layers = fields.positive_int("num_hidden_layers")
    sliding = sliding_fields(fields) or {"sliding_window": fields.positive_int("sliding_window")}
    if not sliding.get("layer_types"):  # configs before layer_types: every `default_pattern`-th layer is global
        kinds = ("sliding_attention" if (i + 1) % default_pattern else "full_attention" for i in range(num_layers))
        sliding["layer_types"] = tuple(kinds)
    # NOTE: HF's Gemma defaults where a key is absent (kiln's shared defaults are Llama's)
    return {
        "hidden_act": fields.activation("hidden_activation", "gelu_pytorch_tanh"),
        "head_dim": fields.positive_int("head_dim", 256),
        "rms_norm_eps": fields.positive_float("rms_norm_eps", 1e-6),
        "tie_word_embeddings": fields.flag("tie_word_embeddings", True),
        "query_pre_attn_scalar": fields.positive_float("query_pre_attn_scalar", 256.0),
        "final_logit_softcapping": _optional_cap(fields, "final_logit_softcapping"),
        **sliding,
    }


def _optional_cap(fields: ConfigFields, key: str) -> float:
    # NOTE: JSON null means no capping, as in HF; kiln cannot tell null from absent, so absent is no capping too
    return 0.0 if fields.lookup(key) is None else fields.positive_float(key)
