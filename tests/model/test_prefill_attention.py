"""Prefill attention for a whole step (kiln.model.prefill_attention): the sequences are cut into groups that pad to
at most PAD_COST of their own work, every sequence in one group, and equal lengths in one call; a batched group
with a soft-cap equals each sequence attended alone. The op's outputs against dense attention, for whole prompts,
chunks after cached context, sliding windows and every KV dtype, are tests/model/test_kv_dtypes.py's and
tests/model/test_sliding_window.py's."""

from __future__ import annotations

import torch

from kiln.model.prefill_attention import PAD_COST, batched_attention, group_prefills


def test_groups_cover_every_sequence_once_within_the_padding_bound() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        count = int(torch.randint(1, 40, (1,), generator=generator))
        seq_lens = torch.randint(1, 3000, (count,), generator=generator).tolist()
        q_lens = [int(torch.randint(1, s + 1, (1,), generator=generator)) for s in seq_lens]
        groups = group_prefills(q_lens, seq_lens)
        assert sorted(i for g in groups for i in g) == list(range(count))
        for g in groups:
            padded = len(g) * max(q_lens[i] for i in g) * max(seq_lens[i] for i in g)
            assert len(g) == 1 or padded <= PAD_COST * sum(q_lens[i] * seq_lens[i] for i in g)


def test_equal_prompts_are_one_call_and_a_long_one_is_not_padded_to() -> None:
    assert group_prefills([128] * 16, [128] * 16) == [list(range(16))]
    groups = group_prefills([128] * 15 + [2000], [128] * 15 + [2000])
    assert groups == [list(range(15)), [15]]


def test_a_soft_capped_group_equals_each_sequence_alone() -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 9, 7]
    rows, keys, softcap = max(lengths), max(lengths), 3.0
    q = torch.randn(3, 6, rows, 16, generator=generator) * 2
    k, v = (torch.randn(3, 2, keys, 16, generator=generator) * 2 for _ in range(2))
    position = torch.arange(rows)[None, :, None]
    cols = torch.arange(keys)[None, None, :]
    lens = torch.tensor(lengths)[:, None, None]
    mask = (cols <= position) & (cols < lens)  # causal, each within its own length
    got = batched_attention(q, k, v, mask, softcap)
    for b, n in enumerate(lengths):
        qg = q[b, :, :n].unflatten(0, (2, 3))  # [Hkv, G, n, D]
        scores = torch.matmul(qg, k[b, :, None, :n].transpose(-1, -2)) * 16**-0.5
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask[b, :n, :n], float("-inf"))
        want = torch.matmul(scores.softmax(-1), v[b, :, None, :n]).flatten(0, 1)
        torch.testing.assert_close(got[b, :, :n], want, rtol=1e-5, atol=1e-5)
