"""`kiln::packed_linear`'s C++ CPU kernel (kiln/kernels/native/dispatch.cpp): a weight bound to a native op runs it
from C++, with no hop through Python; every other binding, and a weight bound to nothing, still runs the Python
implementation's kernel (compiled candidates, BLAS, the reference). A kernel over a form of the weight of its own
(the bf16 copy for the matrix unit) runs its op on that form from C++ too."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.kernels.candidates import native_int8_linear, native_packed_linear
from kiln.kernels.compute_forms import Bf16Form, brgemm_bf16_op
from kiln.kernels.native.build import install_native_dispatch, native_op
from kiln.quant import ops
from tests.quant.test_packed import _packed

pytestmark = pytest.mark.skipif(native_packed_linear() is None, reason="no native tier builds here")


def _weight() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = _packed(GGMLQuantizationType.Q4_1, 48, 128, 3)
    return w.codes.clone(), w.scale.clone(), w.offset.clone()


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, *weight: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return ops.dequant_blas(x, *weight)


def test_a_native_binding_runs_from_cpp_and_the_others_through_python() -> None:
    tier = install_native_dispatch()
    assert tier is not None and install_native_dispatch() == tier  # once per process
    native = native_int8_linear("int8x2")
    assert native is not None
    weight = _weight()
    codes = weight[0]
    python_kernel = Counting()
    ops.bind_kernels(codes, {1: native, 16: python_kernel})
    # the Python side's table now says otherwise for one row: the C++ kernel, which holds its own, never asks it
    stale = Counting()
    ops._BOUND._bound[ops._weight_key(codes)][1][1] = stale
    x1, x8 = torch.randn(1, 128), torch.randn(8, 128)
    assert torch.equal(torch.ops.kiln.packed_linear(x1, *weight), native(x1, *weight))
    assert stale.calls == 0
    out = torch.ops.kiln.packed_linear(x8, *weight)  # 7-16 rows: a Python kernel, called through the fallback
    assert python_kernel.calls == 1
    torch.testing.assert_close(out, ops.dequant_blas(x8, *weight))
    # 2 rows: nothing bound there, the reference runs
    x2 = torch.randn(2, 128)
    torch.testing.assert_close(torch.ops.kiln.packed_linear(x2, *weight), ops.dequant_blas(x2, *weight))


def test_rebinding_and_an_unbound_weight() -> None:
    install_native_dispatch()
    native = native_int8_linear("int8x2")
    weight = _weight()
    codes = weight[0]
    ops.bind_kernels(codes, {1: native})
    python_kernel = Counting()
    ops.bind_kernels(codes, {1: python_kernel})  # the latest binding wins, in C++ too
    x = torch.randn(1, 128)
    torch.ops.kiln.packed_linear(x, *weight)
    assert python_kernel.calls == 1
    other = _weight()  # never bound
    torch.testing.assert_close(torch.ops.kiln.packed_linear(x, *other), ops.dequant_blas(x, *other))


def test_a_binding_names_one_kernel_per_row_class() -> None:
    tier = install_native_dispatch()
    assert tier is not None
    bind = native_op(tier, "bind_packed")
    assert bind is not None
    with pytest.raises(RuntimeError, match="one kernel name and form per row class"):
        bind(_weight()[0], ["", ""], [None, None])
    assert ops.native_op_name(native_int8_linear("int8x2")).startswith("kiln_native_")
    assert ops.native_op_name(ops.dequant_blas) == ""


@pytest.mark.skipif(brgemm_bf16_op() is None, reason="oneDNN's bf16 brgemm needs AVX-512 (this CPU lacks it)")
def test_a_form_binding_runs_its_op_on_its_copy_from_cpp() -> None:
    install_native_dispatch()
    weight = _weight()
    codes = weight[0]

    class CountingForm(Bf16Form):
        calls = 0

        def __call__(self, x: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
            CountingForm.calls += 1
            return super().__call__(x, *w)

    form = CountingForm([weight])
    not_copied = CountingForm([])  # no copy of this weight yet: bound as a Python kernel, copied at its first call
    ops.bind_kernels(codes, {16: form, 64: not_copied})
    x8, x32 = torch.randn(8, 128), torch.randn(32, 128)
    assert torch.equal(torch.ops.kiln.packed_linear(x8, *weight), form(x8, *weight))
    assert CountingForm.calls == 1  # the direct call above alone: the op ran the copy from C++
    torch.testing.assert_close(torch.ops.kiln.packed_linear(x32, *weight), form(x32, *weight))
    assert CountingForm.calls == 3  # through Python, then the direct call
    assert ops.native_form(form, codes)[0].endswith("::brgemm_bf16_linear")
    assert ops.native_form(ops.dequant_blas, codes) == ("", None)
