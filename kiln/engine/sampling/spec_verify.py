"""Speculative decoding's verifying side: which of a sequence's draft tokens the target accepts, and its next token.

A sequence that brought k draft tokens d_1..d_k to a step has k+1 rows of target logits: row j is the target's
distribution after the sequence and d_1..d_j (each row processed with its own history: penalties count the drafts
before it, min_tokens holds EOS off by its own position). Then:
- greedy: the target's pick t_j of each row; d_{j+1} is accepted while it equals t_j, and the tokens emitted are
  t_0..t_m, m the first row whose pick differs (or k), the same tokens plain greedy decoding gives;
- sampled, one-hot proposals (n-gram): each row draws the target's own token t_j as plain decoding would, from
  the generator of its output position (kiln.engine.request.Request.generator_at), and d_{j+1} is accepted while
  it equals t_j. This is the speculative-sampling rule for a one-hot q (d accepted with probability p_j(d), else a
  token from p_j without d), coupled to plain decoding: a seeded request gives the same text whether or not a
  step verified drafts (which depends on timing), as it must;
- sampled, a draft model's proposals q: the standard rule, so the output distribution is exactly the target's.
  d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection a token is drawn from the
  residual max(0, p_j - q_j), normalized, and the rest are dropped; when all k are accepted the target's row k
  draws one more. Row j's uniforms come from its position's generator, so a seeded request repeats.
The filters (temperature, top-k, top-p, min-p) make p_j; a row that is not finite fails its request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sampling.sampler import (
    UNUSABLE_PROBABILITIES,
    SamplingRow,
    adjusted_logits,
    draw,
    filter_batch,
    row_max,
    token_logprobs,
    unsampleable,
)


@dataclass
class Verified:
    """One sequence's verification: the tokens it emits (accepted drafts, then the target's own), their logprobs
    (when asked), or why it could not be sampled."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    error: str | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int],
    draft_probs: torch.Tensor | None = None,
    take_all: bool = False,
) -> Verified:
    """logits: [len(drafts) + 1, vocab] float32, the rows of one sequence; `draft_probs`: [len(drafts), vocab], the
    proposer's distribution at each draft (None: one-hot at the draft, as n-gram proposes). `take_all`: every draft
    is kept whatever the target says (a teacher-forced request's drafts are the tokens it is given)."""
    adjusted = adjusted_logits(logits, rows)
    params = rows[0].params
    best, greedy = row_max(adjusted)
    if not bool(torch.isfinite(best).all()):
        return Verified([], [], unsampleable(logits))
    if params.is_greedy:
        picks = greedy.tolist()
        m = len(drafts) if take_all else next((j for j, d in enumerate(drafts) if picks[j] != d), len(drafts))
        tokens = drafts[:m] + picks[m : m + 1]
    else:
        probs = filter_batch(adjusted, [r.params for r in rows]).softmax(-1)
        if not bool(torch.isfinite(probs).all()):
            return Verified([], [], UNUSABLE_PROBABILITIES)
        if take_all:
            tokens = [*drafts, int(draw(probs[-1:], [rows[-1].generator])[0])]
        elif draft_probs is None:
            picks = draw(probs, [r.generator for r in rows]).tolist()
            m = next((j for j, d in enumerate(drafts) if picks[j] != d), len(drafts))
            tokens = drafts[:m] + picks[m : m + 1]
        else:
            tokens = _speculative_sample(probs, drafts, draft_probs, [r.generator for r in rows])
    logprobs = token_logprobs(logits[: len(tokens)], rows[: len(tokens)], tokens)
    return Verified(tokens, [lp for lp in logprobs if lp is not None])


def _speculative_sample(
    probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generators: list[torch.Generator | None],
) -> list[int]:
    tokens: list[int] = []
    for j, d in enumerate(drafts):
        p, q = probs[j], draft_probs[j]
        if float(torch.rand(1, generator=generators[j], dtype=probs.dtype)) * float(q[d]) < float(p[d]):
            tokens.append(d)
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p and q agree wherever p has mass: the target's own row stands
            residual = p
        tokens.append(int(draw(residual.unsqueeze(0), [generators[j]])[0]))
        return tokens
    tokens.append(int(draw(probs[len(drafts)].unsqueeze(0), [generators[len(drafts)]])[0]))
    return tokens
