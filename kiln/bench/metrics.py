"""What one benchmark run measured (timings per request) and the rates and ratios derived from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

RATIO_METRICS = ("output_tok_s", "prefill_tok_s", "decode_tok_s_per_seq")


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded random token ids, exactly `input_len` per prompt; kiln and every anchor get the same lists."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, input_len), generator=gen).tolist()


@dataclass
class RunResult:
    """One (system, mode, batch size) run: `num_requests` prompts of `input_len`, each decoding `output_len` tokens.

    `wall_s` is the generation run alone; `prefill_s` is the wall time of a separate prefill-only run
    (one output token per request) at the same concurrency. Per request: time to first token and
    time per output token after the first. `roofline_efficiency` (kiln at batch 1, kiln.bench.roofline): the
    roofline time per token over the mean measured one.
    """

    system: str  # "kiln" or an anchor's name ("hf", "llama.cpp")
    mode: str
    batch_size: int
    input_len: int
    output_len: int
    wall_s: float
    prefill_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    token_ids: list[list[int]]
    hf_match: int | None = None  # requests whose greedy tokens equal HF's, when compared
    roofline_efficiency: float | None = None
    prefix_hit_rate: float | None = None  # kiln with prefix caching: prompt tokens found cached in the run
    acceptance_length: float | None = None  # kiln with speculative decoding: tokens per verification in the run

    @classmethod
    def closed_loop(
        cls,
        system: str,
        mode: str,
        batch_size: int,
        prompts: list[list[int]],
        output_len: int,
        wall_s: float,
        prefill_s: float,
        requests: list[tuple[float, float, float, list[int]]],
    ) -> RunResult:
        """A run from its requests' (arrival, first token, finished times, token ids)."""
        return cls(
            system=system,
            mode=mode,
            batch_size=batch_size,
            input_len=len(prompts[0]),
            output_len=output_len,
            wall_s=wall_s,
            prefill_s=prefill_s,
            ttft_s=[first - arrival for arrival, first, _, _ in requests],
            tpot_s=[(finished - first) / (output_len - 1) for _, first, finished, _ in requests],
            token_ids=[ids for *_, ids in requests],
        )

    @property
    def num_requests(self) -> int:
        return len(self.ttft_s)

    @property
    def output_tok_s(self) -> float:
        return self.num_requests * self.output_len / self.wall_s

    @property
    def prefill_tok_s(self) -> float:
        return self.num_requests * self.input_len / self.prefill_s

    @property
    def mean_tpot_s(self) -> float:
        return float(np.mean(self.tpot_s))

    @property
    def decode_tok_s_per_seq(self) -> float:
        return 1.0 / self.mean_tpot_s

    def to_row(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "num_requests": self.num_requests,
            "num_output_tokens": self.num_requests * self.output_len,
            "output_tok_s": self.output_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s_per_seq": self.decode_tok_s_per_seq,
            "ttft_ms": _summary_ms(self.ttft_s),
            "tpot_ms": _summary_ms(self.tpot_s),
            "wall_s": self.wall_s,
        } | _present(
            hf_match=self.hf_match,
            roofline_efficiency=self.roofline_efficiency,
            prefix_hit_rate=self.prefix_hit_rate,
            acceptance_length=self.acceptance_length,
        )


def _present(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90))}


def compute_ratios(results: list[RunResult]) -> dict[str, dict[str, Any]]:
    """`"<mode>/<anchor>"`: kiln over each anchor (hf, llama.cpp) per batch size, plus `best` (best batched
    throughput of each); `"<mode>/eager"`: each graph mode over eager per batch size."""
    by_key = {(r.system, r.mode, r.batch_size): r for r in results}
    anchors = dict.fromkeys(r.system for r in results if r.system != "kiln")
    ratios: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r.mode for r in results if r.system == "kiln"):
        kiln_runs = [r for r in results if r.system == "kiln" and r.mode == mode]
        for anchor in anchors:
            # NOTE: an anchor has one run per batch size; its mode only says how it ran (llama.cpp's differs by bs).
            anchor_runs = {r.batch_size: r for r in results if r.system == anchor}
            entry = _per_batch(kiln_runs, anchor_runs.get)
            entry["best"] = max(r.output_tok_s for r in kiln_runs) / max(r.output_tok_s for r in anchor_runs.values())
            ratios[f"{mode}/{anchor}"] = entry
        if mode != "eager" and any(k[:2] == ("kiln", "eager") for k in by_key):
            ratios[f"{mode}/eager"] = _per_batch(kiln_runs, lambda bs: by_key.get(("kiln", "eager", bs)))
    return ratios


def _per_batch(runs: list[RunResult], baseline_for: Callable[[int], RunResult | None]) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    for run in runs:
        base = baseline_for(run.batch_size)
        if base is not None:
            entry[str(run.batch_size)] = {m: getattr(run, m) / getattr(base, m) for m in RATIO_METRICS}
    return entry
