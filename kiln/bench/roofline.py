"""How close batch-1 decode comes to the memory roofline: the weight bytes a decode step must read, this
machine's measured read bandwidth, and the time per output token those two allow.

At batch 1 a decode step is bound by reading every weight it uses once; the roofline time per token is
`streamed_bytes_per_token / read bandwidth`, and the efficiency of a run is that time over its measured one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch import nn

from kiln.model.build import resident_weight_bytes
from kiln.quant.linear import PackedEmbedding


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """GB/s of a streaming fp32 sum over `num_bytes` (median of `repeats`), with torch's current thread count:
    the way batch-1 decode reads its weights."""
    data = torch.rand(num_bytes // 4)  # rand touches every page, so reads really come from DRAM
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / sorted(times)[len(times) // 2] / 1e9


def streamed_weight_bytes(model: nn.Module, replaced: Mapping[int, int] | None = None) -> int:
    """Weight bytes one decode step reads: the resident weights less every embedding table (plain or packed) that is
    only gathered, one row per token. A table tied to the logits head shares its storage with the head, so it is read
    in full and counts. `replaced`: the data pointer of a weight that a decode step reads in another form (a float
    logits head's one-row second form, kiln.kernels.head_forms) -> the bytes of that form, read instead."""
    replaced = replaced or {}
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, PackedEmbedding))]
    others = {
        t.data_ptr(): t.numel() * t.element_size() for m in model.modules() if m not in tables for t in _own_tensors(m)
    }
    gathered = {t.data_ptr(): t.numel() * t.element_size() for m in tables for t in _own_tensors(m)}
    read_elsewhere = {ptr for ptr in others if ptr not in replaced}
    only_gathered = sum(n for ptr, n in gathered.items() if ptr not in read_elsewhere)
    replaced_weights = sum(n for ptr, n in others.items() if ptr in replaced and ptr not in gathered)
    return resident_weight_bytes(model) - only_gathered - replaced_weights + sum(replaced.values())


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


@dataclass(frozen=True)
class Roofline:
    """kiln's weights against the measured read bandwidth; `gguf_file_bytes` is None when the model is not a
    .gguf file."""

    resident_weight_bytes: int
    streamed_bytes_per_token: int
    read_bandwidth_gbs: float
    gguf_file_bytes: int | None
    second_form_bytes: int = 0  # copies of packed weights for compute-bound row classes (kiln.kernels.compute_forms)
    process_rss_bytes: int = 0  # the whole process's resident memory once the engine is ready

    @classmethod
    def measure(
        cls,
        model: nn.Module,
        model_path: str,
        read_gbs: float,
        second_form_bytes: int = 0,
        replaced: Mapping[int, int] | None = None,
    ) -> Roofline:
        """`replaced`: weights a decode step reads in another form (streamed_weight_bytes)."""
        is_gguf = os.path.isfile(model_path) and model_path.endswith(".gguf")
        return cls(
            resident_weight_bytes=resident_weight_bytes(model),
            streamed_bytes_per_token=streamed_weight_bytes(model, replaced),
            read_bandwidth_gbs=read_gbs,
            gguf_file_bytes=os.path.getsize(model_path) if is_gguf else None,
            second_form_bytes=second_form_bytes,
            process_rss_bytes=psutil.Process().memory_info().rss,
        )

    @property
    def roofline_tpot_s(self) -> float:
        """The least time per output token at batch 1: every streamed weight byte read once at full bandwidth."""
        return self.streamed_bytes_per_token / (self.read_bandwidth_gbs * 1e9)

    @property
    def resident_over_file(self) -> float | None:
        return None if self.gguf_file_bytes is None else self.resident_weight_bytes / self.gguf_file_bytes

    def efficiency(self, tpot_s: float) -> float:
        """Roofline time per token over the measured `tpot_s`: 1.0 would read weights at full bandwidth."""
        return self.roofline_tpot_s / tpot_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "resident_weight_bytes": self.resident_weight_bytes,
            "second_form_bytes": self.second_form_bytes,
            "process_rss_bytes": self.process_rss_bytes,
            "streamed_bytes_per_token": self.streamed_bytes_per_token,
            "read_bandwidth_gbs": self.read_bandwidth_gbs,
            "roofline_tpot_ms": self.roofline_tpot_s * 1000.0,
            "gguf_file_bytes": self.gguf_file_bytes,
            "resident_over_file": self.resident_over_file,
        }
