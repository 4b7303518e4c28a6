"""Rotary settings as HF config.json spells them, read into `ModelConfig.rope_theta` and `rope_scaling`: transformers
5's `rope_parameters` (theta inside) or the older `rope_theta` + `rope_scaling`; linear, llama3 and Phi-3's long-rope
scaling; and Gemma 3's settings per layer kind. kiln.model.loader.gguf_rope reads the same from a GGUF file."""

from __future__ import annotations

from kiln.model.loader.base import ConfigFields, longrope_scaling

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
LLAMA3_OPTIONAL = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_rope(fields: ConfigFields, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from `rope_parameters` (transformers >= 5, theta inside) or from the
    older `rope_theta` + `rope_scaling`."""
    key = "rope_parameters" if fields.lookup("rope_parameters") is not None else "rope_scaling"
    rope = fields.lookup(key) or {}
    if not isinstance(rope, dict):
        example = "{'rope_type': 'linear', 'factor': 2.0}"
        raise fields.error(key, f"must be an object such as {example}, found {rope!r}")
    scaling = ConfigFields(fields.path, rope.get, f"{key}.")
    if "rope_theta" in rope:
        rope_theta = scaling.positive_float("rope_theta")
    else:
        rope_theta = fields.positive_float("rope_theta", default_theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    if kind not in ROPE_TYPES:
        raise scaling.error("rope_type", f"is {kind!r}; kiln runs {', '.join(ROPE_TYPES)}")
    if kind == "longrope":
        return rope_theta, _longrope(fields, scaling, rope)
    scaling.positive_float("factor")
    for optional in LLAMA3_OPTIONAL if kind == "llama3" else ():
        if rope.get(optional) is not None:
            scaling.positive_float(optional)
    return rope_theta, {k: v for k, v in rope.items() if k != "rope_theta"}


def _longrope(fields: ConfigFields, scaling: ConfigFields, rope: dict) -> dict:
    """Phi-3's long-rope: per-frequency short and long factors, an attention factor from the context ratio."""
    head_dim = fields.head_dim()
    if fields.lookup("partial_rotary_factor") not in (None, 1, 1.0):
        raise fields.error("partial_rotary_factor", "must be 1.0: kiln rotates whole heads")
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if (
            not isinstance(value, list)
            or len(value) != head_dim // 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            raise scaling.error(key, f"must be a list of {head_dim // 2} positive numbers (head_dim / 2)")
        factors[key] = [float(v) for v in value]
    # NOTE: Phi-3 keeps the pretraining context length at the top level; newer configs put it in the rope dict
    original = rope.get("original_max_position_embeddings") or fields.positive_int("original_max_position_embeddings")
    longest = fields.positive_int("max_position_embeddings", 2048)
    return longrope_scaling(
        int(original),
        longest,
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
        factor=rope.get("factor"),
        attention_factor=rope.get("attention_factor"),
    )


def hf_rope_by_layer_kind(
    fields: ConfigFields, default_theta: float, default_local: float
) -> tuple[float, dict | None, float]:
    """(global rope_theta, global rope scaling or None, local base) from transformers 5's per-layer-type
    `rope_parameters`, else the older rope_theta, rope_scaling and rope_local_base_freq (Gemma 3)."""
    params = fields.lookup("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = ConfigFields(fields.path, (params["full_attention"] or {}).get, "rope_parameters.full_attention.")
        local = ConfigFields(
            fields.path, (params.get("sliding_attention") or {}).get, "rope_parameters.sliding_attention."
        )
        if local.text("rope_type", "default") != "default":
            raise local.error("rope_type", "must be default: kiln scales only the global layers' rotary embedding")
        theta = full.positive_float("rope_theta", default_theta)
        return theta, _linear_scaling(full), local.positive_float("rope_theta", default_local)
    scaling = fields.lookup("rope_scaling")
    legacy = ConfigFields(fields.path, scaling.get if isinstance(scaling, dict) else {}.get, "rope_scaling.")
    theta = fields.positive_float("rope_theta", default_theta)
    return theta, _linear_scaling(legacy), fields.positive_float("rope_local_base_freq", default_local)


def _linear_scaling(rope: ConfigFields) -> dict | None:
    kind = rope.text("rope_type", rope.lookup("type") or "default")
    if kind == "default":
        return None
    if kind != "linear":
        raise rope.error("rope_type", f"is {kind!r}; kiln runs Gemma 3's default and linear rotary embeddings")
    return {"rope_type": "linear", "factor": rope.positive_float("factor")}
