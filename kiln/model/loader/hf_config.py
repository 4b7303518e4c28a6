"""An HF config.json read into kiln's ModelConfig: its `architectures` pick the family (kiln.model.loader.families),
and the one config reader (kiln.model.loader.config_reader) reads it through an `HFConfigView`. Every bad value is
a ModelLoadError naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.loader.base import ConfigFields
from kiln.model.loader.config_reader import read_model_config
from kiln.model.loader.config_view import HFConfigView
from kiln.model.loader.families import FAMILIES, PLUGIN_ENV, find


def parse_config(config_path: Path, c: dict | None = None) -> ModelConfig:
    """The ModelConfig of an HF config.json (`c`: its parsed contents, read from `config_path` when None)."""
    c = read_config_json(config_path) if c is None else c
    archs = c.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigFields(str(config_path), c.get).error(
            "architectures", f"must be a list of model class names, found {archs!r}"
        )
    family = find(archs)
    if family is None:
        raise ModelLoadError(
            str(config_path),
            f"unsupported architecture {archs}: kiln runs {', '.join(FAMILIES)} (register your own with "
            f"kiln.models.register, in a module named by {PLUGIN_ENV} or a `kiln.models` entry point)",
        )
    return read_model_config(HFConfigView(config_path, c, family.hf_fixed), family)


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
