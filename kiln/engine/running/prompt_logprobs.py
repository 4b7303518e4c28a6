"""Prompt logprobs: how likely the model found each prompt token given the ones before it (vLLM's `prompt_logprobs`,
OpenAI's `echo` with `logprobs`), computed in the prefill.

Row `q` of a prefill chunk scores prompt token `q + 1`: its fp32 logits over the whole vocabulary go through a
log-softmax, and the row keeps the actual next token's logprob and rank (1 + the tokens the model found likelier) and
its `num_top` likeliest tokens (ranks 1..num_top). The first prompt token has no row before it: its entry is None,
as OpenAI and vLLM answer. Every prefill row's hidden state exists in each graph mode (the full decode graph runs
only steps of decodes), so this is exact in all of them.

The rows are scored in slices of at most the rows the logits head's kernels were timed for (the engine's sampled
rows: above them its packed head would run the untimed reference, 3x slower), and never more than `SLICE_ROWS` (a
1,024-token prompt's logits over a 150k vocabulary would be 600 MB at once), on the model's device; no log-softmax
tensor is made (a row's logsumexp is subtracted from the few logits it keeps), and only those few numbers come to
the host. A slice's logsumexps, target logits, ranks and largest logits come from kiln's native kernel in two passes
over each row (`row_scores`; torch ops, where it does not build, take 5-10 passes and ran 20-40x slower: the
scoring cost 1.5x a plain prefill with them); a top-k runs only for requests that ask for more than one alternative.

Where the head multiplies the scored rows on its bf16 brgemm form, the logits are not made at all: `fused` (the
executor's `score_rows`, kiln.kernels.head) folds each tile of them into the same numbers as oneDNN makes it, in
slices of FUSED_SLICE_ROWS rows that each read the head once (the logits of 64-row slices, written and read back,
left the cache and cost more than their product).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kiln.engine.request import Logprob, PromptLogprobs, Request
from kiln.engine.running.step_plan import PromptRows
from kiln.kernels.candidates import widest_native
from kiln.kernels.head import RowScores

SLICE_ROWS = 256  # prompt rows whose logits exist at once
FUSED_SLICE_ROWS = 256  # prompt rows a fused scorer takes at once: their bf16 inputs stay in L2 beside the head's block
# the numbers of each row the fused path gives without logits (None: the logits are made and scored here)
FusedScores = Callable[[torch.Tensor, torch.Tensor], "RowScores | None"]


@dataclass
class PromptScores:
    """A chunk's scored prompt positions: `entries[i]` is position `position + i`'s."""

    position: int
    entries: list[dict[int, Logprob]]


def prompt_rows_of(req: Request, start: int, end: int, first_row: int) -> PromptRows | None:
    """The rows of `req`'s chunk of positions [start, end) (its first at step row `first_row`) that score prompt
    positions it has no logprobs for yet: row q scores token q + 1, so the prompt's last row scores nothing (it
    samples the first output token). None: the chunk scores none."""
    assert req.prompt_logprobs is not None and req.params.prompt_logprobs is not None
    first = max(start, len(req.prompt_logprobs) - 1)
    last = min(end, req.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptRows(
        request_id=req.request_id,
        first_row=first_row + first - start,
        position=first + 1,
        targets=req.prompt_token_ids[first + 1 : last + 1],
        num_top=req.params.prompt_logprobs,
    )


def score_prompt_rows(
    head: Callable[[torch.Tensor, list[int]], torch.Tensor | None],
    hidden: torch.Tensor,
    chunks: list[PromptRows],
    slice_rows: int = SLICE_ROWS,
    fused: FusedScores | None = None,
) -> dict[str, PromptScores]:
    """Each chunk's prompt positions scored from `hidden` (the step's hidden states) by `head` (fp32 logits of the
    rows asked), or by `fused` (hidden rows, targets) where it can and no request asks for more than one
    alternative (a top-k needs the logits), by request id."""
    rows = [row for c in chunks for row in range(c.first_row, c.first_row + len(c.targets))]
    targets = torch.tensor([t for c in chunks for t in c.targets], dtype=torch.long)
    num_top = max(c.num_top for c in chunks)
    picked, ranks, top_lp, top_ids = [], [], [], []
    slices = _scored_slices(
        head, hidden, rows=rows, targets=targets, slice_rows=slice_rows, fused=fused if num_top <= 1 else None
    )
    for (lse, chosen, rank, top_value, top_index), logits in slices:
        picked.append((chosen - lse).cpu())
        ranks.append(rank.cpu())
        if num_top == 1:
            top_lp.append((top_value - lse).unsqueeze(1).cpu())
            top_ids.append(top_index.unsqueeze(1).cpu())
        elif num_top > 1:
            assert logits is not None, "a top-k is taken of logits: the fused path makes none"
            top = logits.topk(num_top, dim=1)
            top_lp.append((top.values - lse.unsqueeze(1)).cpu())
            top_ids.append(top.indices.cpu())
    return _entries(
        chunks,
        picked=torch.cat(picked).tolist(),
        ranks=torch.cat(ranks).tolist(),
        top_lp=torch.cat(top_lp).tolist() if num_top else [],
        top_ids=torch.cat(top_ids).tolist() if num_top else [],
    )


def _scored_slices(
    head: Callable[[torch.Tensor, list[int]], torch.Tensor | None],
    hidden: torch.Tensor,
    *,
    rows: list[int],
    targets: torch.Tensor,
    slice_rows: int,
    fused: FusedScores | None,
) -> Iterator[tuple[RowScores, torch.Tensor | None]]:
    """Each slice's row scores, with its logits where they were made: FUSED_SLICE_ROWS rows at a time by `fused`
    where it scores the first slice (it then scores every one: the same head), else slices of the rows the head's
    kernels were timed for (`slice_rows`, at most SLICE_ROWS) through `head` and `row_scores`."""
    if fused is not None:
        first = fused(hidden[rows[:FUSED_SLICE_ROWS]], targets[:FUSED_SLICE_ROWS])
        if first is not None:
            yield first, None
            for at in range(FUSED_SLICE_ROWS, len(rows), FUSED_SLICE_ROWS):
                scores = fused(hidden[rows[at : at + FUSED_SLICE_ROWS]], targets[at : at + FUSED_SLICE_ROWS])
                assert scores is not None, "the head scored the first slice"
                yield scores, None
            return
    step = max(1, min(slice_rows, SLICE_ROWS))
    for at in range(0, len(rows), step):
        logits = head(hidden, rows[at : at + step])
        assert logits is not None, "prompt logprobs are computed on a single device"
        logits = logits.float()
        yield row_scores(logits, targets[at : at + step]), logits


def row_scores(logits: torch.Tensor, targets: torch.Tensor) -> RowScores:
    """Of each row of `logits` [rows, vocab] (float32) and its target id: the row's logsumexp, the target's logit,
    its rank (1 + the logits greater than it), and the row's largest logit with its first index. kiln's native
    kernel on a CPU where it builds (two passes over a row, kiln/kernels/native/row_scores.cpp); torch ops elsewhere.
    """
    op = native_row_scores() if logits.device.type == "cpu" else None
    if op is not None:
        return op(logits, targets)
    return torch_row_scores(logits, targets.to(logits.device))


def torch_row_scores(logits: torch.Tensor, targets: torch.Tensor) -> RowScores:
    """`row_scores` by torch ops (5-10 passes over the logits, on any device)."""
    chosen = logits.gather(1, targets.unsqueeze(1))
    top = logits.max(dim=1)
    rank = (logits > chosen).sum(dim=1) + 1
    return torch.logsumexp(logits, dim=1), chosen.squeeze(1), rank, top.values, top.indices


@functools.cache
def native_row_scores() -> Callable[[torch.Tensor, torch.Tensor], RowScores] | None:
    """The native `prompt_row_scores` op of the widest tier that builds here (None where none does)."""
    return widest_native("prompt_row_scores")


def _entries(
    chunks: list[PromptRows],
    picked: list[float],
    ranks: list[int],
    top_lp: list[list[float]],
    top_ids: list[list[int]],
) -> dict[str, PromptScores]:
    """The host-side numbers as each chunk's entries: the actual token first, then its `num_top` likeliest."""
    out: dict[str, PromptScores] = {}
    at = 0
    for c in chunks:
        entries = []
        for i, token in enumerate(c.targets):
            entry = {token: Logprob(picked[at + i], ranks[at + i])}
            for r in range(c.num_top):
                entry.setdefault(top_ids[at + i][r], Logprob(top_lp[at + i][r], r + 1))
            entries.append(entry)
        out[c.request_id] = PromptScores(c.position, entries)
        at += len(c.targets)
    return out


def record_prompt_scores(logprobs: PromptLogprobs, scores: PromptScores) -> None:
    """Append `scores`' positions that `logprobs` lacks (a preempted request recomputes positions it has)."""
    assert scores.position <= len(logprobs), "prompt logprobs arrive in position order"
    logprobs.extend(scores.entries[len(logprobs) - scores.position :])
