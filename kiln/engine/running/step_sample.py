"""A step's sampled rows turned into each sequence's new tokens (`ModelRunnerOutput`): the rows of sequences that
decode as usual through the batched sampler in one call, each verifying sequence's rows (its last token's and its
draft tokens', kiln.engine.speculation.speculation) through kiln.engine.sampling.spec_verify.

Each row is sampled with its own history: a verifying sequence's row j sees the sequence's output and its first j
draft tokens (penalties count them; min_tokens holds EOS off by the row's own position; a structured output's
grammar masks it as it stands after those drafts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from kiln.engine.request import PooledSum, Request
from kiln.engine.running.prompt_logprobs import PromptScores
from kiln.engine.running.step_plan import StepPlan
from kiln.engine.sampling.sampler import Sampler, SamplerOutput, SamplingRow
from kiln.engine.sampling.spec_verify import verify
from kiln.engine.scheduling.scheduler_output import ScheduledRequest, SchedulerOutput

# the distribution each of a step's sampled drafts was drawn from, by request id (a draft model's proposals)
DraftProbs = Mapping[str, list[torch.Tensor]]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]]  # request id -> the tokens it emits this step (one; a verification: 1 to k+1)
    logprobs: dict[str, list[dict[int, float]]]  # per emitted token, for the requests asking for logprobs
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its row could not be sampled
    # request id -> the prompt positions its prefill chunk scored (kiln.engine.running.prompt_logprobs)
    prompt_logprobs: dict[str, PromptScores] = field(default_factory=dict)
    # request id -> the rows its embedding's prefill chunk pooled (kiln.engine.running.pooling)
    pooled: dict[str, PooledSum] = field(default_factory=dict)


def sampling_row(
    req: Request, drafts: list[int], eos_token_ids: list[int], allowed: torch.Tensor | None
) -> SamplingRow:
    """The row that samples `req`'s next token after its output and `drafts`."""
    p = req.params
    output = req.output_token_ids + drafts if drafts else req.output_token_ids
    block_eos = eos_token_ids + p.stop_token_ids if len(output) < p.min_tokens else []
    generator = req.generator_at(len(output))
    return SamplingRow(p, req.prompt_token_ids, output, generator, block_eos, allowed, req.keeps_probs)


def sample_step(
    sampler: Sampler,
    sched: SchedulerOutput,
    plan: StepPlan,
    logits: torch.Tensor,
    eos_token_ids: list[int],
    draft_probs: DraftProbs,
) -> ModelRunnerOutput:
    """logits: [len(plan.sample_indices), vocab] float32 on the host, in the plan's row order; `draft_probs`: the
    distribution each sampled draft was drawn from, by request id (kiln.engine.speculation.speculation.Proposals)."""
    by_id = {s.request.request_id: s for s in sched.scheduled}
    first_row: dict[str, int] = {}
    for i, rid in enumerate(plan.sample_request_ids):
        first_row.setdefault(rid, i)
    out = ModelRunnerOutput({}, {})
    plain = [rid for rid in first_row if not by_id[rid].spec_token_ids]
    checked = {rid for rid in plain if by_id[rid].request.grammar is not None and _checked_after(by_id[rid].request)}
    masks = _grammar_masks([by_id[rid] for rid in first_row if rid not in checked])
    rows = [sampling_row(by_id[rid].request, [], eos_token_ids, _row(masks, rid, 0)) for rid in plain]
    if plain:
        every = len(plain) == len(plan.sample_request_ids)
        plain_logits = logits if every else logits[torch.tensor([first_row[rid] for rid in plain])]
        drawn = sampler(plain_logits, rows)
        _redraw_refused(sampler, plain_logits, rows, [by_id[rid].request for rid in plain], checked, drawn)
        for i, rid in enumerate(plain):
            _record(out, rid, [drawn.token_ids[i]], [lp] if (lp := drawn.logprobs[i]) else [], drawn.errors[i])
            if rows[i].keep_probs and drawn.probs[i] is not None:  # a draft engine's request keeps its draft's
                by_id[rid].request.sampled_probs.append(drawn.probs[i])
    for rid, start in first_row.items():
        s = by_id[rid]
        if drafts := s.spec_token_ids:
            spec_rows = [
                sampling_row(s.request, drafts[:j], eos_token_ids, _row(masks, rid, j)) for j in range(len(drafts) + 1)
            ]
            kept = draft_probs.get(rid)
            q = torch.stack(kept[: len(drafts)]) if kept and len(kept) >= len(drafts) else None
            forced = s.request.forced_output is not None  # a teacher-forced request's drafts are its given tokens
            v = verify(logits[start : start + len(drafts) + 1], spec_rows, drafts, q, take_all=forced)
            _record(out, rid, v.token_ids, v.logprobs, v.error)
    return out


def _checked_after(req: Request) -> bool:
    """Whether `req`'s row samples before its grammar mask and checks the token after
    (kiln.engine.structured.structured_output: exact for greedy rows and rows whose only filter is temperature; logprobs
    are the model's own either way)."""
    p = req.params
    return p.is_greedy or (p.top_k in (0, -1) and p.top_p == 1.0 and p.min_p == 0.0)


def _redraw_refused(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    requests: list[Request],
    checked: set[str],
    drawn: SamplerOutput,
) -> None:
    """The rows in `checked` whose token their grammar refuses, sampled again with their masks (in `drawn`)."""
    refused = [
        i
        for i, req in enumerate(requests)
        if req.request_id in checked and drawn.errors[i] is None and not req.grammar.allows(drawn.token_ids[i])
    ]
    if not refused:
        return
    states = [requests[i].grammar for i in refused]
    masks = states[0].grammars.bitmasks(states)  # type: ignore[union-attr]
    again = sampler(logits[torch.tensor(refused)], [replace(rows[i], allowed=masks[j]) for j, i in enumerate(refused)])
    for j, i in enumerate(refused):
        drawn.token_ids[i], drawn.logprobs[i], drawn.errors[i] = again.token_ids[j], again.logprobs[j], again.errors[j]


def _grammar_masks(scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
    """The grammar masks of a step's constrained sequences, computed all at once: a decoding sequence's one row,
    a verifying one's row per position (its drafts are within its grammar, kiln.engine.speculation.speculation), by
    request id."""
    constrained = [s for s in scheduled if s.request.grammar is not None]
    if not constrained:
        return {}
    states = [s.request.grammar for s in constrained]
    drafts = [s.spec_token_ids or [] for s in constrained]
    rows = states[0].grammars.bitmasks(states, drafts)  # type: ignore[union-attr]
    masks, at = {}, 0
    for s, tokens in zip(constrained, drafts, strict=True):
        masks[s.request.request_id] = rows[at : at + 1 + len(tokens)]
        at += 1 + len(tokens)
    return masks


def _row(masks: dict[str, torch.Tensor], request_id: str, position: int) -> torch.Tensor | None:
    rows = masks.get(request_id)
    return None if rows is None else rows[position]


def _record(
    out: ModelRunnerOutput, rid: str, tokens: list[int], logprobs: list[dict[int, float]], error: str | None
) -> None:
    if error is not None:
        out.errors[rid] = error
        return
    out.sampled[rid] = tokens
    if logprobs:
        out.logprobs[rid] = logprobs
