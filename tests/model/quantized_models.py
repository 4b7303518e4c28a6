"""Tiny quantized HF checkpoints written in the tests: compressed-tensors ones by the compressed-tensors package's
own lifecycle (apply a scheme, set data-free min/max scales, compress, save), GPTQ and AWQ ones in their documented
tensor layouts (no gptqmodel or autoawq here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.engine.tiny_models import write_hf_model

# preset -> changes to its weights' args (tiny layers: groups and blocks of 32)
PRESETS = {
    "W4A16": {"group_size": 32},
    "W4A16_CHANNEL": {"strategy": "channel", "group_size": None},
    "W4A16_ASYM": {"group_size": 32},
    "W8A16": {"group_size": 32},
    "W8A8": {},
    "FP8": {},
    "FP8_DYNAMIC": {},
    "FP8_BLOCK": {"block_structure": [32, 32]},
}


def write_compressed_model(directory: Path, preset: str, perturb: float = 0.05) -> torch.nn.Module:
    """A tiny Llama quantized under a compressed-tensors preset (PRESETS; `lm_head` ignored), compressed and saved
    with its tokenizer; returns the compressed HF model."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = write_hf_model(directory, "llama", perturb=perturb)
    scheme = preset_name_to_scheme(preset.removesuffix("_CHANNEL"), ["Linear"])
    for key, value in PRESETS[preset].items():
        setattr(scheme.weights, key, value)
    if scheme.input_activations is not None and scheme.input_activations.strategy == "group":
        scheme.input_activations.group_size = 32
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _set_minmax_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return model


def _set_minmax_qparams(module: torch.nn.Module) -> None:
    """Data-free scales and zero points: each group's (channel's, block's, the tensor's) min and max; a static
    activation scale of 1/64 where the scheme has one."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args, w = module.quantization_scheme.weights, module.weight.data
    if args.strategy == "group":
        groups = w.reshape(w.shape[0], -1, args.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
    elif args.strategy == "channel":
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        blocks = w.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if hasattr(module, "input_scale"):
        module.input_scale.data.fill_(1 / 64)


def edit_quantization_config(directory: Path, **changes: object) -> Path:
    """Change fields of config.json's quantization_config; returns config.json's path."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))
    return path
