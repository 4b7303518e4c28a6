"""HF model directories: config.json + *.safetensors + tokenizer.json."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kiln.config import ModelConfig
from kiln.errors import ModelLoadError
from kiln.model.loader.base import CheckpointHeader

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_DTYPES = ("F32", "F16", "BF16")


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file, checked against the file size (no tensor data is read)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(str(path), "truncated: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ModelLoadError(str(path), f"truncated or corrupt: header claims {n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(str(path), f"corrupt safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise ModelLoadError(str(path), f"truncated: tensor data ends at byte {8 + n + end}, file has {size}")
    return header


class HFCheckpoint:
    """An HF-format directory; construction reads config.json and the safetensors headers only."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.dir = Path(path)
        cfg_path = self.dir / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(path, "not a model directory: config.json is missing")
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(str(cfg_path), f"invalid JSON ({exc})") from None
        self.files = sorted(self.dir.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(path, "no *.safetensors weight files in the directory")
        self.headers = {f: read_safetensors_header(f) for f in self.files}

    @cached_property
    def tensor_types(self) -> dict[str, str]:
        return {name: info["dtype"] for h in self.headers.values() for name, info in h.items()}

    @cached_property
    def config(self) -> ModelConfig:
        c = self.hf_config
        archs = c.get("architectures") or []
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                str(self.dir / "config.json"),
                f"unsupported architecture {archs}: kiln runs {', '.join(HF_ARCHITECTURES)}",
            )
        try:
            num_heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            eos = c.get("eos_token_id")
            # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`
            rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            return ModelConfig(
                architecture=arch,
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
                head_dim=int(c.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=rope or None,
                max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
                bos_token_id=c.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
                name=str(c.get("_name_or_path") or self.dir.name),
            )
        except KeyError as exc:
            raise ModelLoadError(str(self.dir / "config.json"), f"missing key {exc.args[0]!r}") from None

    def header(self) -> CheckpointHeader:
        return CheckpointHeader(
            path=self.path,
            format="hf",
            config=self.config,
            tensor_types=dict(self.tensor_types),
            tensor_shapes={n: tuple(i["shape"]) for h in self.headers.values() for n, i in h.items()},
        )

    def rope_freq_factors(self) -> torch.Tensor | None:
        return None

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_types)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        bad = {n: t for n, t in self.tensor_types.items() if t not in SUPPORTED_DTYPES}
        if bad:
            name, ty = next(iter(bad.items()))
            raise ModelLoadError(
                self.path, f"unsupported tensor dtype {ty} (tensor {name}); kiln loads {SUPPORTED_DTYPES}"
            )
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118  (safe_open is not a dict)
                        yield name, st.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(str(f), f"corrupt safetensors file ({exc})") from None


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path)
