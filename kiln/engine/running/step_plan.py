"""A step's inputs as plain lists (what rank 0 sends the other ranks of a multi-device engine), and their split into
micro-batches for pipeline parallelism. The plan carries the step's KV block copies (prefix caching's copy on
write of a shared partial block), so every rank copies the same blocks of its own caches before the forward.

With S pipeline stages and one batch per step, each stage idles while the others work (a bubble of (S-1)/S). Split
into M parts, stage 0 starts part 2 while stage 1 runs part 1, and the bubble shrinks to (S-1)/(M+S-1); kiln splits
each step into S parts (when it has that many sequences), balanced by tokens, keeping the sequences' order (decodes
first, as attention expects).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.lora.manager import SlotLoad


@dataclass
class PromptRows:
    """A prefill chunk's rows that score its prompt's next tokens (kiln.engine.running.prompt_logprobs): row
    `first_row + i` scores prompt position `position + i`, whose token is `targets[i]`."""

    request_id: str
    first_row: int
    position: int
    targets: list[int]
    num_top: int


@dataclass
class PoolRows:
    """A prefill chunk's rows that an embedding request pools (kiln.engine.running.pooling): rows `first_row` to
    `first_row + num_rows` hold its prompt positions from `position` on."""

    request_id: str
    first_row: int
    position: int
    num_rows: int


@dataclass
class StepPlan:
    """One step's inputs as plain lists (built from the scheduler's output by `ModelRunner.plan`)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    padded: int
    batch_size: int
    sample_indices: list[int]
    sample_request_ids: list[str]
    # a hybrid model's sliding layers' own slots and block tables (kiln.engine.scheduling.kv_window); empty otherwise
    window_slots: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)
    # (source, copy) blocks each rank copies in its KV caches before the forward (kiln.engine.scheduling.prefix_sharing)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # draft tokens the step verifies, each a decode row of its own (speculative decoding runs on one device, so a
    # micro-batch split never sees any)
    num_draft_tokens: int = 0
    # prefill chunks whose prompt logprobs are asked for (a single device's steps only: multi-device engines refuse
    # them, kiln.engine.scheduling.admission)
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # embedding requests' prefill chunks, the rows each pools (a single device's steps only, as prompt_rows)
    pool_rows: list[PoolRows] = field(default_factory=list)
    # each token's LoRA slot (kiln.lora; -1: the base model), when the engine serves adapters; empty otherwise
    lora_slots: list[int] = field(default_factory=list)
    # the adapters rank 0 copied into slots for this step, which every other rank copies before it runs the step
    lora_loads: list[SlotLoad] = field(default_factory=list)


def split_plan(plan: StepPlan, parts: int, pad_to: Callable[[int], int]) -> list[StepPlan]:
    """`plan` as up to `parts` plans of consecutive sequences with about equal tokens, each padded by `pad_to`."""
    starts = plan.query_start_loc
    total, num_seqs = starts[-1], len(plan.seq_lens)
    parts = min(parts, num_seqs)
    # cut before the first sequence that starts at or past each k/parts of the tokens (at least one sequence each)
    cuts = [0]
    for k in range(1, parts):
        at = next(
            i for i in range(cuts[-1] + 1, num_seqs) if starts[i] * parts >= k * total or num_seqs - i <= parts - k
        )
        cuts.append(at)
    cuts.append(num_seqs)
    return [_part(plan, a, b, pad_to) for a, b in itertools.pairwise(cuts) if b > a]


def _part(plan: StepPlan, first: int, end: int, pad_to: Callable[[int], int]) -> StepPlan:
    lo, hi = plan.query_start_loc[first], plan.query_start_loc[end]
    sampled = [(i, rid) for i, rid in zip(plan.sample_indices, plan.sample_request_ids, strict=True) if lo <= i < hi]
    return StepPlan(
        input_ids=plan.input_ids[lo:hi],
        positions=plan.positions[lo:hi],
        slots=plan.slots[lo:hi],
        query_start_loc=[q - lo for q in plan.query_start_loc[first : end + 1]],
        seq_lens=plan.seq_lens[first:end],
        block_tables=plan.block_tables[first:end],
        num_decodes=max(0, min(plan.num_decodes, end) - first),
        padded=pad_to(hi - lo),
        batch_size=end - first,
        sample_indices=[i - lo for i, _ in sampled],
        sample_request_ids=[rid for _, rid in sampled],
        window_slots=plan.window_slots[lo:hi],
        window_tables=plan.window_tables[first:end],
        block_copies=plan.block_copies if first == 0 else [],
        lora_slots=plan.lora_slots[lo:hi],
    )


def kv_slots(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV-cache slots of positions [start, end) of a sequence whose logical blocks are `blocks`."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


def padded_tables(tables: list[list[int]]) -> list[list[int]]:
    """Block tables as rows of one width (the longest), padded with block 0 (past every sequence's length)."""
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]
