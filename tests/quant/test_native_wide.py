"""kiln's wide int8-activation kernels (packed_q8_wide.cpp: x's one or two int8 digits widened to one int16 each,
128 q + q2, and multiplied by `vpmaddwd`) equal the plain-torch statement of the same arithmetic
(kiln.kernels.native.reference) within 1e-5, for every packed GGUF type and kiln's int8/int4 schemes, at 1, 2, 7, 32
and 100 rows (row blocks of 4 and their tails); at the ends of the codes' and digits' ranges, in groups up to the
1,024 values whose sums must stay within int32; they exist exactly in the avx512 and avx2 tiers this CPU runs, and
the kernel table times them up to WIDE_MAX_ROWS rows."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.kernels.candidates import CANDIDATES, NATIVE_INT8_WIDE, NATIVE_INT8X2_WIDE, WIDE_MAX_ROWS
from kiln.kernels.native.build import TIER_NAMES, native_op, runnable_tiers
from kiln.kernels.native.reference import q8_linear
from kiln.quant.linear import PackedLinear
from tests.quant.test_native_int8 import ROWS, WEIGHTS, assert_within
from tests.quant.test_packed import _packed

WIDE = {"packed_linear_q8_wide": 1, "packed_linear_q8x2_wide": 2}  # op -> int8 digits
TIERS = [t.name for t in runnable_tiers() if t.name in ("avx512", "avx2")]


@pytest.mark.parametrize("op_name", list(WIDE))
@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("tier", TIERS)
def test_wide_ops_equal_the_reference_arithmetic(tier: str, name: str, op_name: str) -> None:
    op = native_op(tier, op_name)
    assert op is not None, f"the {tier} tier runs on this CPU, so its wide ops must build and load"
    weight = WEIGHTS[name]
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = op(x, weight.codes, weight.scale, weight.offset)
        assert got.shape == (rows, 72)
        assert_within(got, q8_linear(x, weight.codes, weight.scale, weight.offset, WIDE[op_name]), 1e-5)


@pytest.mark.parametrize("op_name", list(WIDE))
@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda k: k.name)
@pytest.mark.parametrize("tier", TIERS)
def test_wide_ops_over_extreme_codes_and_a_strided_x(tier: str, kind: GGMLQuantizationType, op_name: str) -> None:
    """Codes at the ends of their range (nibbles 15 and 0, int8 127 and -128: a sign-extended widening, never a
    zero-extended one), activations at their largest, a transposed x, 37 outputs over 3 groups (an odd count)."""
    op = native_op(tier, op_name)
    assert op is not None
    weight = _packed(kind, 37, 96, 7)
    ends = torch.rand(weight.codes.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    if kind == GGMLQuantizationType.Q4_1:
        codes = torch.where(ends, 0x0F, 0xF0).to(torch.uint8)
    else:
        codes = torch.where(ends, 127, -128).to(torch.int8)
    for rows in (1, 3, 6, 17):
        x = (torch.randn(96, rows, generator=torch.Generator().manual_seed(rows)) * 100).t()
        want = q8_linear(x, codes, weight.scale, weight.offset, WIDE[op_name])
        assert_within(op(x, codes, weight.scale, weight.offset), want, 1e-5)


@pytest.mark.parametrize("tier", TIERS)
def test_wide_sums_of_the_largest_group_stay_within_int32(tier: str) -> None:
    """A group of 1,024 int8 codes of -128 against two digits near their largest (128 x 127 + q2): each int32 lane
    sums 128 products of at most 128 x 16,320 (2.7e8, under 2^31); the op equals the reference, and refuses a larger
    group (packed_q8.cpp's bound)."""
    op = native_op(tier, "packed_linear_q8x2_wide")
    assert op is not None
    codes = torch.full((8, 1, 1024), -128, dtype=torch.int8)
    scale, offset = torch.full((8, 1, 1), 1e-3), torch.zeros(8, 1, 1)
    x = torch.full((2, 1024), 7.0)
    x[:, ::3] = 6.97  # digits other than the top one: q2 takes both signs
    assert_within(op(x, codes, scale, offset), q8_linear(x, codes, scale, offset, 2), 1e-5)
    with pytest.raises(RuntimeError, match="groups of at most 1024 values, got 2048"):
        op(torch.randn(1, 2048), torch.zeros(4, 1, 2048, dtype=torch.int8), torch.ones(4, 1, 1), torch.zeros(4, 1, 1))


def test_wide_ops_exist_exactly_in_the_vector_tiers_this_cpu_runs() -> None:
    for tier in TIER_NAMES:
        for op_name in WIDE:
            assert (native_op(tier, op_name) is not None) == (tier in TIERS), (tier, op_name)
    nibbles, int8 = PackedLinear(64, 48, bits=4), PackedLinear(64, 48, bits=8)
    for name in (NATIVE_INT8_WIDE, NATIVE_INT8X2_WIDE):  # any codes, from one row to WIDE_MAX_ROWS
        candidate = CANDIDATES[name]
        assert candidate.applies(nibbles, 1) == candidate.applies(int8, WIDE_MAX_ROWS) == bool(TIERS)
        assert not candidate.applies(nibbles, WIDE_MAX_ROWS + 1)
        assert not candidate.applies(PackedLinear(2048, 4, bits=8, group=2048), 1)
