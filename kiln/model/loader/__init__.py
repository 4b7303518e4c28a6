"""Checkpoint loading: `open_checkpoint(path)` picks the format; headers never read weights.

A checkpoint (either class below) offers `config`, `header()`, `weight_shapes()` (HF names, from headers),
`weights()` (HF-named tensors, read lazily one at a time), `rope_freq_factors()`, `num_tensors`, and for messages
`file_of(name)` and `tensor_label(name)`. Anything malformed it finds is a `ModelLoadError` naming the file.

base.py           what every checkpoint loader returns, a file's version (size, mtime) that memos of parsed files
                  key on, typed reads of config fields (how a model name becomes a path: kiln.model.paths)
families.py       model families: one entry per family under its HF and GGUF names, with its model class, GGUF layout
                  and config reader
config_view.py    a checkpoint's settings under config.json's names, from config.json or GGUF metadata alike
config_reader.py  the one config reader: a ModelConfig from a config view (shared settings, then the family's own)
gguf_layout.py    how a family's GGUF files are laid out: tensor names, value transforms, what llama.cpp leaves out
gguf_loader.py    GGUF checkpoints: header, dequantized weights (via the `gguf` package) and tokenizer metadata
gguf_reader.py    the GGUF header reader: gguf's, checked against cut files, quick on long arrays
gguf_names.py     GGUF tensor names -> HF parameter names (llama.cpp's naming of the Llama family)
gguf_rope.py      rope scaling in GGUF files: linear (metadata), llama 3.1's `rope_freqs` tensor, Phi-3's long-rope
hf_config.py      an HF config.json read into kiln's ModelConfig; a bad value is a ModelLoadError naming the field
hf_rope.py        rope settings as config.json spells them: rope_parameters or rope_theta + rope_scaling, per layer kind
hf_loader.py      HF model directories: config.json + *.safetensors + tokenizer.json
hf_quant.py       an HF checkpoint's quantization_config (compressed-tensors, GPTQ, AWQ): its quantized layers' tensors
hf_quant_layers.py  the quantized layers of one HF checkpoint: names, shapes, packed layouts, each layer read
"""

from __future__ import annotations

import os

from kiln.errors import ModelLoadError
from kiln.model.loader.base import CheckpointHeader
from kiln.model.loader.gguf_loader import GGUFCheckpoint
from kiln.model.loader.hf_loader import HFCheckpoint
from kiln.model.paths import default_model_path, resolve_model_path

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
