"""Compute forms: a second copy of a packed weight, laid out for a compute-bound kernel, kept beside the packed codes
and used only by the row classes where its kernel was timed fastest (kiln.kernels.packed).

The packed codes are the fewest bytes a weight can be read in, which is what one or two rows of a decode step are
bound by. Many rows (batched decode, prefill chunks, verification steps) are bound by arithmetic instead, and on a
CPU with a matrix unit (AMX) oneDNN's tile kernels do 4-10x the integer dot products kiln's own packed kernels do,
but they multiply a layout of their own, not blocks of codes with a scale and an offset per 32 values.

The bf16 form: the weight dequantized exactly (code * scale + offset, float32), rounded to bf16 once and stored
in oneDNN's VNNI order for `cpublas::brgemm` (kiln/kernels/native/dense_brgemm.cpp): [blocks, in / 2, BLOCK_N, 2],
two bytes a weight (Q4_1's codes take 0.625). The product rounds x to bf16 and accumulates in float32, written
as float32. On the default model, every packed layer computing this way at every row class gives a mean KL of
1.5e-4 against float32 activations over 1,200 tokens, top-1 agreement 99.3 % (tests/quant/test_compute_forms.py
measures it; the bar is 1e-3 and 99 %); rounding the output to bf16 too, as `F.linear` in bf16 does, gave 7.5e-4
and 97.5 %. A requantized int8 per-channel copy with per-token int8 activations (oneDNN's qlinear) gave 4.2e-2
and 87.8 %: not a candidate.

Whether the matrix unit computes correctly here is probed once per machine in a child process (a fault there
cannot take the engine down; a VM that lists AMX but loses tile state would show as wrong sums) and cached with
the kernel choices; where the probe fails, no bf16 form is timed. kiln's own AMX-INT8 products of the packed codes
(packed_q8_amx.cpp, no second form: the `native-int8*-amx` candidates) are probed the same way (`amx_int8_works`).
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import weakref
from collections.abc import Callable

import torch

from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.native.build import amx_int8_present, native_op, source_hash
from kiln.kernels.native.reference import q8_linear
from kiln.quant.ops import dequantize_codes

logger = logging.getLogger("kiln")

BLOCK_N = 32  # outputs per packed block (dense_brgemm.cpp BLOCK_N)
PROBE_TIMEOUT_S = 300
# rows and (outputs, inputs) the probe checks: a tail block, a tail row block, several row blocks
PROBE_SHAPES = ((1, 40, 64), (7, 96, 128), (70, 64, 96), (300, 200, 576))
PROBE_TOLERANCE = 1e-5  # relative to the largest output: the same bf16 inputs summed in float32, in another order


def brgemm_bf16_op() -> Callable[..., torch.Tensor] | None:
    """kiln's bf16 brgemm product (the avx512 tier's), None where it does not load here."""
    return native_op("avx512", "brgemm_bf16_linear")


def pack_bf16(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The bf16 form of a packed weight: [blocks, in / 2, BLOCK_N, 2], outputs past the weight's zero."""
    weight = dequantize_codes(codes, scale.float(), offset.float()).reshape(codes.shape[0], -1)
    return pack_dense_bf16(weight)


def pack_dense_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A float [out, in] weight (in even) in the bf16 form's VNNI order."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK_N)
    padded = weight.new_zeros(blocks * BLOCK_N, in_features)
    padded[:out_features] = weight
    pairs = padded.view(blocks, BLOCK_N, in_features // 2, 2).permute(0, 2, 1, 3)
    return pairs.to(torch.bfloat16).contiguous()


def bf16_form_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // BLOCK_N) * BLOCK_N * in_features * 2


def reference_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The bf16 form's arithmetic in plain torch: x and the float weight rounded to bf16, products summed in float32."""
    return x.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().t()


class Bf16Form:
    """The bf16 product over its own copy of each weight it is given (packed up front) or called on (packed at the
    first call). `copy_bytes` is what its copies hold."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        op = brgemm_bf16_op()
        if op is None:
            raise RuntimeError("the bf16 brgemm product does not load here (kiln.kernels.native)")
        self.op = op
        self.copies: dict[int, torch.Tensor] = {}  # the codes' address -> the bf16 form
        for weight in weights:
            self.copy(*weight)

    def copy(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        form = self.copies.get(codes.data_ptr())
        if form is None:
            form = self.copies[codes.data_ptr()] = pack_bf16(codes, scale, offset)
        return form

    def native_form(self, codes: torch.Tensor) -> tuple[str, torch.Tensor | None]:
        """The op and this weight's copy, for `kiln::packed_linear`'s C++ kernel to call without Python
        (kiln.quant.ops.native_form); none for a weight not copied yet."""
        form = self.copies.get(codes.data_ptr())
        return (self.op._qualified_op_name, form) if form is not None else ("", None)

    @property
    def copy_bytes(self) -> int:
        return sum(form.numel() * form.element_size() for form in self.copies.values())

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return self.op(x.float(), self.copy(codes, scale, offset), codes.shape[0]).to(x.dtype)


class FormMemo:
    """One form per list of weights it is made for, while the first weight's codes live: a race makes a candidate's
    kernel at every row count over the same copies of a weight, and a layer's row classes share one copy."""

    def __init__(self, make: Callable[[list], object]) -> None:
        self.make = make
        self.forms: dict[int, object] = {}  # id of the first weight's codes -> its form (dropped when they die)

    def __call__(self, weights: list) -> object:
        if not weights:
            return self.make(weights)
        codes = weights[0][0]
        form = self.forms.get(id(codes))
        if form is None:
            form = self.forms[id(codes)] = self.make(weights)
            weakref.finalize(codes, self.forms.pop, id(codes), None)
        return form


def probe_matrix_unit() -> dict[str, object]:
    """Run the bf16 brgemm product against its plain-torch reference in this process (what the child runs)."""
    op = brgemm_bf16_op()
    if op is None:
        return {"ok": False, "why": "the native avx512 tier does not load here"}
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, out_features, in_features in PROBE_SHAPES:
        x = torch.randn(rows, in_features, generator=generator)
        weight = torch.randn(out_features, in_features, generator=generator)
        got = op(x, pack_dense_bf16(weight), out_features)
        want = reference_bf16(x, weight)
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return {"ok": worst <= PROBE_TOLERANCE, "worst_relative_error": worst}


def matrix_unit_works(cache: KernelChoiceCache) -> bool:
    """Whether the bf16 brgemm product computes correctly here: probed once per machine, native sources and torch
    in a child process (a crash or a wrong sum there says no), then read from the kernel choice cache."""
    if brgemm_bf16_op() is None:
        return False
    record = cache.choose("matrix_unit_probe", {"native": source_hash(), "shapes": PROBE_SHAPES}, _probe_in_child)
    if not record.get("ok"):
        logger.info("Compute forms: off, the matrix unit's probe failed here (%s)", record.get("why", record))
    return bool(record.get("ok"))


# rows, outputs, inputs: a tail of outputs (not a multiple of 16), one A tile, two (rows past 16 / digits)
AMX_INT8_PROBE_SHAPES = ((1, 40, 64), (5, 96, 128), (7, 200, 576), (33, 64, 96))
AMX_INT8_OPS = {1: "packed_linear_q8_amx", 2: "packed_linear_q8x2_amx"}  # by digits of x


def probe_amx_int8() -> dict[str, object]:
    """Run kiln's AMX-INT8 products on 4-bit and int8 codes against their plain-torch reference in this process (what
    the child runs)."""
    ops = {digits: native_op("avx512", name) for digits, name in AMX_INT8_OPS.items()}
    if any(op is None for op in ops.values()):
        return {"ok": False, "why": "the native avx512 tier does not load here"}
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, out_features, in_features in AMX_INT8_PROBE_SHAPES:
        groups = in_features // 32
        x = torch.randn(rows, in_features, generator=generator)
        scale = torch.rand(out_features, groups, 1, generator=generator) + 0.5
        offset = torch.randn(out_features, groups, 1, generator=generator)
        nibbles = torch.randint(0, 256, (out_features, groups, 16), generator=generator, dtype=torch.uint8)
        int8 = torch.randint(-128, 128, (out_features, groups, 32), generator=generator, dtype=torch.int8)
        for codes, digits in itertools.product((nibbles, int8), ops):
            got = ops[digits](x, codes, scale, offset)
            want = q8_linear(x, codes, scale, offset, digits=digits)
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return {"ok": worst <= PROBE_TOLERANCE, "worst_relative_error": worst}


def amx_int8_works(cache: KernelChoiceCache) -> bool:
    """Whether kiln's AMX-INT8 products compute correctly here: probed once per machine, native sources and torch in
    a child process (a fault there, a refused tile state or a wrong sum says no), then read from the cache."""
    if not amx_int8_present():  # no tiles to probe: a child would only die of SIGILL
        return False
    if any(native_op("avx512", name) is None for name in AMX_INT8_OPS.values()):
        return False
    key = {"native": source_hash(), "shapes": AMX_INT8_PROBE_SHAPES}
    record = cache.choose("amx_int8_probe", key, lambda: _probe_in_child("probe_amx_int8"))
    if not record.get("ok"):
        logger.info("AMX-INT8 products: off, their probe failed here (%s)", record.get("why", record))
    return bool(record.get("ok"))


def _probe_in_child(probe: str = "probe_matrix_unit") -> dict[str, object]:
    """Run this module's function `probe` in a child process; its record, or why there is none."""
    script = f"import json, kiln.kernels.compute_forms as f; print(json.dumps(f.{probe}()))"
    command = [sys.executable, "-c", script]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"the probe took more than {PROBE_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"ok": False, "why": f"the probe process exited with {done.returncode}"}
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"ok": False, "why": "the probe printed no result"}
