"""An HF config.json read into kiln's ModelConfig: the fields every family shares, rope scaling (linear, llama3,
Phi-3's long-rope), then the family's own fields through its reader (kiln.model.loader.families). Every bad value
is a ModelLoadError naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.loader.base import ConfigFields, longrope_scaling
from kiln.model.loader.families import FAMILIES, PLUGIN_ENV, find

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
LLAMA3_OPTIONAL = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def parse_config(config_path: Path, c: dict | None = None) -> ModelConfig:
    """The ModelConfig of an HF config.json (`c`: its parsed contents, read from `config_path` when None)."""
    c = read_config_json(config_path) if c is None else c
    fields = ConfigFields(str(config_path), c.get)
    archs = c.get("architectures") or []
    if not isinstance(archs, list):
        raise fields.error("architectures", f"must be a list of model class names, found {archs!r}")
    family = find(archs)
    if family is None:
        raise ModelLoadError(
            str(config_path),
            f"unsupported architecture {archs}: kiln runs {', '.join(FAMILIES)} (register your own with "
            f"kiln.models.register, in a module named by {PLUGIN_ENV} or a `kiln.models` entry point)",
        )
    hidden = fields.positive_int("hidden_size")
    num_heads = fields.positive_int("num_attention_heads")
    rope_theta, rope_scaling = _rope(fields)
    reader = family.reader()
    own = reader(fields) if reader is not None else {}
    shared = dict(
        architecture=family.architecture,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_layers=fields.positive_int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=fields.kv_heads("num_attention_heads", num_heads, "num_key_value_heads"),
        head_dim=fields.head_dim("hidden_size", hidden, "num_attention_heads", num_heads, "head_dim"),
        rms_norm_eps=fields.positive_float("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=fields.positive_int("max_position_embeddings", 2048),
        tie_word_embeddings=fields.flag("tie_word_embeddings", False),
        attention_bias=fields.flag("attention_bias", False),
        bos_token_id=fields.token_id("bos_token_id"),
        eos_token_ids=fields.token_ids("eos_token_id"),
        name=fields.text("_name_or_path", "") or config_path.parent.name,
        hidden_act=fields.activation("hidden_act", "silu"),
    )
    return ModelConfig(**{**shared, **own})


def _rope(fields: ConfigFields) -> tuple[float, dict | None]:
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
        rope_theta = fields.positive_float("rope_theta", 10000.0)
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
    heads = fields.positive_int("num_attention_heads")
    head_dim = fields.head_dim(
        "hidden_size", fields.positive_int("hidden_size"), "num_attention_heads", heads, "head_dim"
    )
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
        factors["short_factor"],
        factors["long_factor"],
        rope.get("factor"),
        rope.get("attention_factor"),
    )


def read_config_json(path: Path) -> dict:
    """config.json as a dict; unreadable, non-UTF-8 or non-JSON text is a ModelLoadError."""
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ModelLoadError(str(path), f"cannot read the file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ModelLoadError(str(path), f"not UTF-8 text ({exc}); config.json must be a UTF-8 JSON object") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(str(path), f"invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(str(path), f"expected a JSON object of model settings, found {type(config).__name__}")
    return config
