"""The sampler as it was before it was batched (one row at a time in Python): the reference the batched sampler
(kiln.engine.sampling.sampler) must equal, and the baseline of scripts/sampler_bench.py."""

from __future__ import annotations

import torch

from kiln.engine.sampling.sampler import SamplerOutput, SamplingRow, adjusted_logits, token_logprobs
from kiln.engine.sampling.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        vocab = logits.shape[1]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids + row.output_token_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts.to(logits.dtype)
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row; removed entries become -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p; the top token always stays, even when a tiny
        # top_p (1e-46) rounds to 0 in float32
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class RowwiseSampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [len(rows), vocab] float32. Returns one token (and optional logprobs) per row."""
        raw = logits
        logits = apply_penalties(adjusted_logits(logits, rows, penalised=False), rows)
        # NOTE: one pass finds both the greedy tokens and the rows that cannot be sampled: a row's max is NaN or
        # inf when any logit is NaN or +inf, and -inf when every candidate was masked out.
        best, greedy = logits.max(dim=-1)
        token_ids = greedy.tolist()
        errors: list[str | None] = [None] * len(rows)
        for i in torch.nonzero(~torch.isfinite(best)).flatten().tolist():
            errors[i] = (
                "no token is left to sample: every candidate was masked out or penalised to -inf"
                if bool(torch.isfinite(raw[i]).all())
                else "the model produced non-finite logits (NaN or inf) for this sequence"
            )
        for i, row in enumerate(rows):
            if errors[i] is not None:
                continue
            if not row.params.is_greedy:
                probs = filter_logits(logits[i], row.params).softmax(-1)
                if not torch.isfinite(probs).all():
                    errors[i] = "the sampling probabilities are not finite; check temperature and penalties"
                    continue
                token_ids[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())
        return SamplerOutput(token_ids, token_logprobs(raw, rows, token_ids), errors)
