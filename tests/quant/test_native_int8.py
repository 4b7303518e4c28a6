"""kiln's int8-activation kernels (packed_q8.cpp): every ISA tier this CPU runs equals the plain-torch statement of
the same arithmetic (kiln.kernels.native.reference: x quantized per weight group, integer code sums, the same
scales) within 1e-5, for every packed GGUF type and kiln's load-time int8/int4 schemes, at 1, 2, 7, 32 and 100
rows, on blocks written with the gguf package; the reference itself stays close to dequantize-then-float32; the
engine times the int8 candidate only where it runs int8 activations."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.compile.compiler import make_compiler
from kiln.kernels.candidates import (
    BRGEMM_BF16,
    CANDIDATES,
    NATIVE_INT8,
    NATIVE_INT8_AMX,
    NATIVE_INT8_BLOCKED,
    NATIVE_INT8_STREAMED,
    NATIVE_INT8_WIDE,
    NATIVE_INT8X2,
    NATIVE_INT8X2_AMX,
    NATIVE_INT8X2_BLOCKED,
    NATIVE_INT8X2_STREAMED,
    NATIVE_INT8X2_WIDE,
    candidates_for,
    native_blocked_linear,
)
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.kernels.native.reference import q8_linear, quantize_activations
from kiln.kernels.packed import PackedKernelTable
from kiln.quant.gguf_blocks import PACKED_TYPES
from kiln.quant.linear import PackedLinear, PackedTensor
from kiln.quant.ops import dequant_blas
from kiln.quant.quantize import quantize
from tests.quant.test_packed import _packed

RUNNABLE = [t.name for t in runnable_tiers()]
ROWS = (1, 2, 7, 32, 100)
DIGITS = {"packed_linear_q8": 1, "packed_linear_q8x2": 2}  # the op of one int8 digit and of two


def weights() -> dict[str, PackedTensor]:
    """Every packed layout kiln runs: each GGUF type's blocks, and kiln's own int8/int4 schemes (groups of 32)."""
    out = {kind.name: _packed(kind, 72, 512, int(kind)) for kind in PACKED_TYPES}
    dense = torch.randn(72, 512, generator=torch.Generator().manual_seed(3))
    out |= {f"kiln-{scheme}": quantize(dense, scheme) for scheme in ("int8", "int4")}
    return out


WEIGHTS = weights()


def assert_within(got: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
    torch.testing.assert_close(got, ref, rtol=tolerance, atol=tolerance * ref.abs().max().item())


@pytest.mark.parametrize("op_name", list(DIGITS))
@pytest.mark.parametrize("tier", RUNNABLE)
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_every_tier_equals_the_reference_arithmetic(tier: str, name: str, op_name: str) -> None:
    op = native_op(tier, op_name)
    assert op is not None, f"the {tier} tier runs on this CPU, so it must build and load"
    weight = WEIGHTS[name]
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = op(x, weight.codes, weight.scale, weight.offset)
        assert got.shape == (rows, 72)
        assert_within(got, q8_linear(x, *weight_parts(weight), DIGITS[op_name]), 1e-5)


@pytest.mark.parametrize("op_name", list(DIGITS))
@pytest.mark.parametrize("tier", RUNNABLE)
@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda k: k.name)
def test_odd_outputs_rows_and_strided_x(tier: str, kind: GGMLQuantizationType, op_name: str) -> None:
    """37 outputs (a remainder after every vector tile, run by the scalar tail) and 3, 5, 9 rows: the tail once
    read negative int8 codes as unsigned where GCC vectorised it into vpdpbusd."""
    op = native_op(tier, op_name)
    assert op is not None
    weight = _packed(kind, 37, 96, 5)
    for rows in (3, 5, 9):
        x = torch.randn(96, rows).t()  # a transposed view
        want = q8_linear(x, *weight_parts(weight), DIGITS[op_name])
        assert_within(op(x, weight.codes, weight.scale, weight.offset), want, 1e-5)


@pytest.mark.parametrize("op_name", list(DIGITS))
def test_a_group_of_zeros_or_subnormals_adds_nothing(op_name: str) -> None:
    """A group whose largest |x| is 0 or subnormal quantizes to 0 (its scale would overflow 1/d): finite, and the
    same as the reference."""
    op = native_op(RUNNABLE[0], op_name)
    assert op is not None
    weight = WEIGHTS["Q4_1"]
    x = torch.randn(2, 512)
    x[0, :32] = 0
    x[1, 32:64] = 1e-39  # subnormal in float32
    got = op(x, *weight_parts(weight))
    assert torch.isfinite(got).all()
    assert_within(got, q8_linear(x, *weight_parts(weight), DIGITS[op_name]), 1e-5)


def weight_parts(weight: PackedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return weight.codes, weight.scale, weight.offset


def test_the_reference_quantizes_as_llama_cpp_does_and_stays_near_float32() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, d, xsum = quantize_activations(x, 4)
    assert q.tolist() == [[[64, -127, 32, 0]], [[0, 0, 0, 0]]]  # round(x * 127 / max|x|), half to even
    assert d[0, 0].item() == pytest.approx(1 / 127) and d[1, 0].item() == 0
    assert xsum.flatten().tolist() == [-0.25, 0.0]
    weight = WEIGHTS["Q4_1"]
    x = torch.randn(16, 512)
    ref = dequant_blas(x, *weight_parts(weight))
    relative = ((q8_linear(x, *weight_parts(weight)) - ref).norm() / ref.norm()).item()
    assert 0 < relative < 0.02  # int8 activations: close to float32, and not the same numbers


def test_bad_operands_are_clear_errors() -> None:
    op = native_op(RUNNABLE[0], "packed_linear_q8")
    assert op is not None
    weight = WEIGHTS["Q8_0"]
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 512"):
        op(torch.randn(1, 32), *weight_parts(weight))
    with pytest.raises(ValueError, match="no native op 'packed_linear_q4'"):
        native_op(RUNNABLE[0], "packed_linear_q4")
    big = torch.zeros(4, 1, 2048, dtype=torch.int8), torch.ones(4, 1, 1), torch.zeros(4, 1, 1)
    with pytest.raises(RuntimeError, match="groups of at most 1024 values, got 2048"):
        op(torch.randn(1, 2048), *big)
    assert not CANDIDATES[NATIVE_INT8X2].applies(PackedLinear(2048, 4, bits=8, group=2048), 1)


def test_int8_candidates_are_timed_only_for_int8_activations(tmp_path) -> None:
    floats = set(candidates_for("float32"))
    one = {NATIVE_INT8, NATIVE_INT8_BLOCKED, NATIVE_INT8_STREAMED, NATIVE_INT8_WIDE}
    two = {NATIVE_INT8X2, NATIVE_INT8X2_BLOCKED, NATIVE_INT8X2_STREAMED, NATIVE_INT8X2_WIDE}
    bf16 = {BRGEMM_BF16}  # the second form for the matrix unit: admitted by int8 engines (test_compute_forms.py)
    one |= {NATIVE_INT8_AMX}  # the matrix unit's integer sums (test_native_amx.py)
    two |= {NATIVE_INT8X2_AMX}
    assert not floats & (one | two | bf16)
    assert set(candidates_for("int8")) == floats | one | bf16
    assert set(candidates_for("int8x2")) == floats | two | bf16
    assert set(CANDIDATES) == floats | one | two | bf16
    model = torch.nn.Sequential(PackedLinear(64, 48, bits=4))
    model[0].load_rows(0, _packed(GGMLQuantizationType.Q4_1, 48, 64, 2))
    cache = KernelChoiceCache(tmp_path)
    compiler = make_compiler("inductor")
    for activations, int8 in (("float32", None), ("int8", NATIVE_INT8), ("int8x2", NATIVE_INT8X2)):
        table = PackedKernelTable(model, compiler, cache, activations)
        (record,) = table.records.values()
        timed = set().union(*(set(times) for times in record["times_us"].values()))
        assert timed & {NATIVE_INT8, NATIVE_INT8X2} == ({int8} if int8 else set())
        # the blocked, streamed and wide forms of the same digits, where a vector tier runs them
        forms = {f"{int8}-blocked", f"{int8}-streamed", f"{int8}-wide"}
        vector_forms = (one | two) - {NATIVE_INT8, NATIVE_INT8X2, NATIVE_INT8_AMX, NATIVE_INT8X2_AMX}
        assert timed & vector_forms == (forms if int8 and native_blocked_linear(activations) else set())
        assert table.int8_runs == (int8 is not None)
