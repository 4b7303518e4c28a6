"""Checkpoint loading: `open_checkpoint(path)` picks the format; headers never read weights.

A checkpoint (either class below) offers `config`, `header()`, `weight_shapes()` (HF names, from headers),
`weights()` (HF-named tensors, read lazily one at a time), `rope_freq_factors()`, `num_tensors`, and for messages
`file_of(name)` and `tensor_label(name)`. Anything malformed it finds is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import os

from kiln.errors import ModelLoadError
from kiln.model.loader.base import CheckpointHeader, default_model_path, resolve_model_path
from kiln.model.loader.gguf_loader import GGUFCheckpoint
from kiln.model.loader.hf_loader import HFCheckpoint

Checkpoint = GGUFCheckpoint | HFCheckpoint


def open_checkpoint(model: str | None) -> Checkpoint:
    """Open a checkpoint by name or path ("default"/None = bundled SmolLM2-135M); reads headers only."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return HFCheckpoint(path)
    if path.endswith(".gguf"):
        return GGUFCheckpoint(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read the file ({exc.strerror or exc})") from None
    if magic == b"GGUF":
        return GGUFCheckpoint(path)
    raise ModelLoadError(path, "unknown model file: expected a .gguf file or an HF model directory")


def read_checkpoint_header(model: str | None) -> CheckpointHeader:
    return open_checkpoint(model).header()


__all__ = [
    "Checkpoint",
    "CheckpointHeader",
    "GGUFCheckpoint",
    "HFCheckpoint",
    "default_model_path",
    "open_checkpoint",
    "read_checkpoint_header",
    "resolve_model_path",
]
