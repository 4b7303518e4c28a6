"""A step split into micro-batches for the pipeline: consecutive sequences, balanced by tokens, each part a complete
plan of its own (its tokens, slots, tables, decodes and sampled rows re-based)."""

from __future__ import annotations

from itertools import chain

from kiln.engine.running.step_plan import StepPlan, split_plan


def step(lens: list[int], num_decodes: int) -> StepPlan:
    """Sequences with `lens` new tokens each (the first `num_decodes` of them decodes); every sequence samples."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    ids = list(range(100, 100 + starts[-1]))
    return StepPlan(
        input_ids=ids,
        positions=list(range(starts[-1])),
        slots=[i + 1000 for i in range(starts[-1])],
        query_start_loc=starts,
        seq_lens=[n + 7 for n in lens],
        block_tables=[[s] for s in range(len(lens))],
        num_decodes=num_decodes,
        padded=starts[-1],
        batch_size=len(lens),
        sample_indices=[e - 1 for e in starts[1:]],
        sample_request_ids=[f"r{i}" for i in range(len(lens))],
    )


def test_decodes_split_evenly_and_rebased() -> None:
    plan = step([1] * 6, 6)
    a, b = split_plan(plan, 2, lambda n: 4 if n <= 4 else n)
    assert a.input_ids == [100, 101, 102] and b.input_ids == [103, 104, 105]
    assert b.query_start_loc == [0, 1, 2, 3] and b.slots == [1003, 1004, 1005]
    assert (a.num_decodes, b.num_decodes) == (3, 3) and a.padded == b.padded == 4
    assert b.sample_indices == [0, 1, 2] and b.sample_request_ids == ["r3", "r4", "r5"]
    assert b.block_tables == [[3], [4], [5]] and b.batch_size == 3


def test_parts_balance_tokens_keep_order_and_cover_everything() -> None:
    plan = step([1, 1, 1, 9, 4], 3)
    parts = split_plan(plan, 2, lambda n: n)
    assert [p.batch_size for p in parts] == [4, 1]  # 12 of 16 tokens, then 4: the cut after the first half
    assert list(chain.from_iterable(p.input_ids for p in parts)) == plan.input_ids
    assert list(chain.from_iterable(p.sample_request_ids for p in parts)) == plan.sample_request_ids
    assert [p.num_decodes for p in parts] == [3, 0]


def test_never_more_parts_than_sequences_and_none_empty() -> None:
    plan = step([20, 1], 0)
    parts = split_plan(plan, 4, lambda n: n)
    assert [p.batch_size for p in parts] == [1, 1]
    assert split_plan(step([5], 0), 3, lambda n: n)[0].input_ids == list(range(100, 105))
