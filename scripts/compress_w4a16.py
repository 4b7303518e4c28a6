"""Write a compressed-tensors W4A16 checkpoint of a model, data-free (min/max scales per group), with the
compressed-tensors package's own lifecycle: what llm-compressor's data-free W4A16 scheme writes, without
llm-compressor (it pins another transformers). For bring-up and for benchmarking kiln's W4A16 path against the GGUF
it came from:

    .venv/bin/python scripts/compress_w4a16.py --model default --out /tmp/smollm2-w4a16 [--group-size 32] [--asym]
    .venv/bin/kiln generate --model /tmp/smollm2-w4a16 --prompt "Hello"

A GGUF is dequantized by transformers first (its `gguf_file` loader); `lm_head` stays unquantized (ignored).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from kiln.model.loader import resolve_model_path


def load_float_model(model: str) -> tuple[torch.nn.Module, object]:
    """(float32 HF model, tokenizer) of a .gguf file or an HF directory."""
    path = Path(resolve_model_path(model))
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if gguf else path
    # NOTE: dequantize=True: transformers otherwise keeps GGUF blocks packed, and such a model cannot be saved
    dense = {"quantization_config": transformers.GgufConfig(dequantize=True)} if gguf else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf, **dense)
    return hf.eval(), transformers.AutoTokenizer.from_pretrained(folder, **gguf)


def compress(model: torch.nn.Module, group_size: int, symmetric: bool) -> ModelCompressor:
    scheme = preset_name_to_scheme("W4A16" if symmetric else "W4A16_ASYM", ["Linear"])
    scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        groups = module.weight.data.reshape(module.weight.shape[0], -1, group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a .gguf file, an HF directory, or 'default'")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--group-size", type=int, default=32, help="weights per scale (llm-compressor: 128)")
    parser.add_argument("--asym", action="store_true", help="zero points per group (W4A16_ASYM)")
    args = parser.parse_args()
    model, tokenizer = load_float_model(args.model)
    compressor = compress(model, args.group_size, symmetric=not args.asym)
    model.save_pretrained(args.out)
    compressor.update_config(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
