"""Embeddings: an embedding request's prompt pooled into one vector from its final hidden states (after the model's
final norm, what HF's `model.model(ids).last_hidden_state` holds), as vLLM pools decoder models: the last prompt
token's (the default), the mean over the prompt's tokens, or the first token's (`cls`); L2-normalized unless the
engine is told not to (kiln.config.PoolingConfig).

An embedding request (`SamplingParams.embed`) is prefill only: its chunks run in the engine's steps beside any
other request's, it samples nothing, and it finishes (its blocks freed) in the update of the step that computed its
last prompt token. Each chunk pools the rows of the positions its mode reads (`POOLED_SPAN`) into their fp32 sum,
one host copy per step for every chunk; the request keeps the running sum and the positions counted, so the vector
is the sum over the count. A request recomputed from position 0 (preempted) starts its sum again. Every prefill
row's hidden state exists in each graph mode (as for prompt logprobs), so this is exact in all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.engine.request import PooledSum, Request
from kiln.engine.running.step_plan import PoolRows

# pooling mode -> the positions of a chunk [start, end) of an n-token prompt it reads, as (first, end): empty when
# first >= end
POOLED_SPAN: dict[str, Callable[[int, int, int], tuple[int, int]]] = {
    "last": lambda start, end, n: (max(start, n - 1), end),
    "mean": lambda start, end, n: (start, end),
    "cls": lambda start, end, n: (start, min(end, 1)),
}


def pool_rows_of(req: Request, start: int, end: int, first_row: int, mode: str) -> PoolRows | None:
    """The rows of `req`'s chunk of positions [start, end) (its first at step row `first_row`) that `mode` pools.
    None: the chunk pools none (a `last` request's chunks before its last, a `cls` one's after its first)."""
    first, stop = POOLED_SPAN[mode](start, end, req.num_prompt_tokens)
    if first >= stop:
        return None
    return PoolRows(
        request_id=req.request_id, first_row=first_row + first - start, position=first, num_rows=stop - first
    )


def pool_step_rows(hidden: torch.Tensor, chunks: list[PoolRows]) -> dict[str, PooledSum]:
    """Each chunk's rows of `hidden` (the step's hidden states) summed in fp32, copied to the host at once, by
    request id."""
    sums = torch.stack([hidden[c.first_row : c.first_row + c.num_rows].float().sum(dim=0) for c in chunks]).cpu()
    return {c.request_id: PooledSum(c.position, sums[i], c.num_rows) for i, c in enumerate(chunks)}


def record_pooled(held: PooledSum | None, chunk: PooledSum) -> PooledSum:
    """`held` (a request's sum so far) with `chunk` added; a chunk from position 0 starts the sum again (a request
    recomputed after preemption pools its prompt anew)."""
    if held is None or chunk.position == 0:
        return chunk
    assert chunk.position == held.position + held.count, "pooled chunks arrive in position order"
    return PooledSum(held.position, held.total + chunk.total, held.count + chunk.count)


def embedding_of(pooled: PooledSum, normalize: bool) -> list[float]:
    """The request's vector: the mean of its pooled rows (one row for `last` and `cls`), L2-normalized if asked."""
    vector = pooled.total / pooled.count
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
