"""The one config reader: a checkpoint's `ModelConfig` from its `ConfigView` (kiln.model.loader.config_view), the
same code for HF config.json and GGUF metadata. It reads the settings every family shares, then hands a copy to the
family's own reader (kiln.model.loader.families), which fills the typed parts only some families have."""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.errors import ConfigError
from kiln.model.loader.config_view import ConfigView
from kiln.model.loader.families import Family


def read_model_config(view: ConfigView, family: Family) -> ModelConfig:
    """The ModelConfig of family `family`'s checkpoint whose settings `view` reads; a bad or missing value is a
    ModelLoadError naming the file and the field as the file names it."""
    hidden = view.positive_int("hidden_size")
    num_heads = view.positive_int("num_attention_heads")
    rope_theta, rope_scaling = view.rope()
    shared = ModelConfig(
        architecture=family.architecture,
        vocab_size=view.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=view.positive_int("intermediate_size"),
        num_layers=view.positive_int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=view.kv_heads("num_attention_heads", num_heads, "num_key_value_heads"),
        head_dim=view.head_dim(),
        rms_norm_eps=view.positive_float("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=view.positive_int("max_position_embeddings", 2048),
        tie_word_embeddings=view.flag("tie_word_embeddings", False),
        attention_bias=view.flag("attention_bias", False),
        bos_token_id=view.token_id("bos_token_id"),
        eos_token_ids=view.token_ids("eos_token_id"),
        name=view.text("_name_or_path", "") or view.default_name,
        hidden_act=view.activation("hidden_act", "silu"),
    )
    reader = family.reader()
    if reader is None:
        return shared
    config = reader(view, shared)
    if not isinstance(config, ModelConfig):
        raise ConfigError(
            f"the config reader of {family.architecture} ({family.read_config!r}) returned {type(config).__name__}: "
            "a reader returns the ModelConfig it was given with its family's fields set, "
            "dataclasses.replace(config, ...) (kiln.models)"
        )
    return config
