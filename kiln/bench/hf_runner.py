"""The HF transformers anchor: `model.generate` in static batches on the same checkpoint, prompts and dtype."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import gguf
import torch
from tqdm import tqdm

from kiln.bench.metrics import RunResult
from kiln.errors import KilnError
from kiln.model.dtypes import parse_dtype
from kiln.model.loader.gguf_reader import CheckedReader

logger = logging.getLogger("kiln")


def auto_model_class() -> Any:
    """transformers' AutoModelForCausalLM, or a KilnError saying how to install transformers."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise KilnError("--compare hf needs HF transformers: pip install 'kiln-infer[hf]'") from exc
    return AutoModelForCausalLM


@contextmanager
def quick_gguf_reads() -> Iterator[None]:
    """transformers reading GGUF files, the same way but quicker: with kiln's header reader in place of gguf's (the
    same fields, long arrays read in one pass: tests/model/test_gguf_reader.py) and each tensor-name map built once
    (transformers builds one per module, at 29 ms each). The tensors are still decoded by transformers and gguf.
    SmolLM2's GGUF loaded in 37 s without it on a 2-core EPYC, most of it in these two (three header reads)."""
    name_map = functools.cache(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", CheckedReader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        yield


def load_hf_model(path: str, dtype: str, device: str) -> Any:
    """The checkpoint kiln loaded (a .gguf file, dequantized by transformers, or an HF directory), on kiln's device."""
    auto_model = auto_model_class()
    start = time.monotonic()
    if os.path.isdir(path):
        model = auto_model.from_pretrained(path, dtype=parse_dtype(dtype))
    else:
        with quick_gguf_reads():
            model = auto_model.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=parse_dtype(dtype)
            )
    logger.info("Loaded HF transformers model from %s in %.2f s", path, time.monotonic() - start)
    return model.to(device).eval()


def run_hf(model: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> RunResult:
    """Static batches of `batch_size`. Per batch, a `max_new_tokens=1` generate times the prefill (for prefill
    tok/s, as kiln's prefill-only pass does); the full generate timestamps each decoding step through a streamer,
    giving every sequence of the batch its TTFT and its time per output token after the first."""
    wall_s = prefill_s = 0.0
    ttft: list[float] = []
    tpot: list[float] = []
    token_ids: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc=f"hf bs={batch_size}", unit="req")
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        prefill_s += _generate(model, batch, 1).elapsed_s
        run = _generate(model, batch, output_len)
        wall_s += run.elapsed_s
        ttft += [run.ttft_s] * len(batch)
        tpot += [run.tpot_s] * len(batch)
        token_ids += run.token_ids
        bar.update(len(batch))
    bar.close()
    return RunResult(
        system="hf",
        mode="eager",
        batch_size=batch_size,
        input_len=len(prompts[0]),
        output_len=output_len,
        wall_s=wall_s,
        prefill_s=prefill_s,
        ttft_s=ttft,
        tpot_s=tpot,
        token_ids=token_ids,
    )


def warm_up_hf(model: Any, prompt: list[int]) -> None:
    _generate(model, [prompt], 2)


class _StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.num_puts = 0

    def put(self, value: torch.Tensor) -> None:
        if self.num_puts:
            self.step_times.append(time.monotonic())
        self.num_puts += 1

    def end(self) -> None:
        pass


@dataclass
class _Generation:
    elapsed_s: float
    ttft_s: float
    tpot_s: float
    token_ids: list[list[int]]


def _generate(model: Any, batch: list[list[int]], num_tokens: int) -> _Generation:
    pad_id = model.generation_config.pad_token_id or 0
    width = max(len(p) for p in batch)
    # NOTE: left padding, so that every sequence's next token follows its own last prompt token.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    clock = _StepClock()
    start = time.monotonic()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )
    token_ids = out[:, width:].tolist()
    elapsed = time.monotonic() - start
    first, last = clock.step_times[0], clock.step_times[-1]
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return _Generation(elapsed, first - start, tpot, token_ids)
