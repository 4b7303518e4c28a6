"""The candidates of the packed kernel table (kiln.kernels.packed): every way kiln has to compute `x [rows, in] @ W.T`,
W packed as codes, scales and offsets per group, one `PackedCandidate` each in `CANDIDATES` (a new kernel is one
subclass and one entry). A candidate's `activations` says which arithmetic it is: float32 candidates compute what
dequantize-then-fp32 computes (in another order); int8 and int8x2 candidates quantize x per weight group first, to
one or two int8 digits (kiln.kernels.native.reference), and are timed only where the engine runs those activations
(`--activations`).

float32:
- `dequant-blas`: W dequantized by torch ops, then the BLAS product (the reference);
- `compiled-dequant-blas`: W dequantized by one inductor kernel, then the BLAS product;
- `tiled-dequant-blas` (more than 2 rows, more than TILE_ROWS outputs): the same, TILE_ROWS output rows at a time,
  so each dequantized tile is still in cache when BLAS reads it (the logits head at batch 32: 20 ms against 70 ms
  dequantized whole and 27 ms for the float32 head, measured on a 2-core EPYC);
- `fused-reduction` (1 and 2 rows): the product as one reduction over the codes (kiln.quant.ops.reduction),
  compiled for the static row count, so the weight streams at its packed width and is never written out;
- `int4pack-mm` (4-bit codes in groups of 32, where this torch has the op): torch's CPU int4 kernel over a copy
  of the codes repacked into its layout (held by the kernel, made once per weight);
- `native` (float32 scales, where kiln's C++ kernels build and load here): kiln's own kernel (kiln.kernels.native)
  over the packed codes as they are, the weight dequantized in registers, at any row count.
int8 / int8x2:
- `native-int8` / `native-int8x2`: kiln's own kernel over the packed codes as they are, x quantized per weight
  group to one int8 digit (llama.cpp's q8 arithmetic) or two (about 15 bits), integer dot products (AVX-512 VNNI
  vpdpbusd, AVX2 vpmaddubsw);
- `native-int8-blocked` / `native-int8x2-blocked` (more than 2 rows; AVX-512 VNNI, or AVX2 for 4-bit codes): the same
  arithmetic with the codes of 16 (8) outputs transposed per call into one 32-bit word per output and lane, so one
  broadcast of 4 activation bytes feeds them all and the float epilogue runs once per 16 (8); the transposition is
  shared by the rows;
- `native-int8-streamed` / `native-int8x2-streamed` (up to STREAMED_MAX_ROWS rows, where the blocked form runs): the
  blocked arithmetic with the codes transposed in registers as they are used, no scratch: the weight streams as
  the lane kernel streams it at one row, and one unpacking serves up to 8 rows;
- `native-int8-wide` / `native-int8x2-wide` (up to WIDE_MAX_ROWS rows; AVX2 or AVX-512, any codes): the same
  arithmetic with x's digits widened to one int16 each (two digits are 128 q + q2), so one `vpmaddwd` per 16
  codes gives both digits' sums, each output's codes read in order with no lane work across outputs;
- `native-int8-amx` / `native-int8x2-amx` (3 to AMX_MAX_ROWS rows, where the CPU's AMX-INT8 tiles passed their probe
  in a child process, kiln.kernels.compute_forms): the same arithmetic, each group's integer sums of every row and
  digit (up to 16 tile rows) by one tile multiply of the streamed form's transposed codes; the vector units keep the
  transposition and the float epilogue. For a speculative verification step's 5 rows with two digits, where the
  VNNI forms are compute-bound (packed_q8_amx.cpp).
The native candidates run the widest ISA tier this CPU can run (what cpuid allows; timing picks the kernel).
bf16 (a second form of the weight, kiln.kernels.compute_forms; timed for int8 and int8x2 engines, whose arithmetic
is approximate too, where the engine allows second forms and the matrix unit's probe passed):
- `brgemm-bf16` (more than 2 rows): a bf16 copy of the weight in oneDNN's VNNI order times x rounded to bf16, summed
  in float32 by oneDNN's brgemm ukernel (AMX tiles where the CPU has them).
A candidate whose kernel holds a copy of the weight (`second_form`) is made per layer at install, and its copies
count against the engine's budget for second forms (kiln.kernels.packed).

The candidates that build something (compile, repack) race after those that build nothing, and are built only
where their floor leaves them a chance to win (kiln.kernels.race): compiled-dequant-blas can take no less than
dequant-blas's BLAS part, any candidate no less than its own time at fewer rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, cast

import torch
from torch import nn

from kiln.compile.compiler import PieceCompiler
from kiln.kernels.compute_forms import Bf16Form, FormMemo, bf16_form_bytes, brgemm_bf16_op
from kiln.kernels.native.build import amx_int8_present, native_op, runnable_tiers
from kiln.kernels.product import shared_compile
from kiln.kernels.torch_kernels import TILE_ROWS, Int4Packed, Tiled, Weight, dequantizer, layer_weight
from kiln.quant.linear import PackedLinear
from kiln.quant.ops import GEMV_ROWS, Kernel, dequant_blas, reduction

FLOAT32, INT8, INT8X2, BF16 = "float32", "int8", "int8x2", "bf16"
INT8_MAX_GROUP = 1024  # packed_q8.cpp's MAX_GROUP: two digits' integer sums of a larger group could pass int32
BLOCKED_MAX_GROUP = 512  # packed_q8_blocked.cpp's MAX_SHIFTED_GROUP: the same for int8 codes shifted by 128
STREAMED_MAX_ROWS = 16  # the streamed forms are timed up to this many rows (the scratch form wins many more)
INT8_OPS = {INT8: "packed_linear_q8", INT8X2: "packed_linear_q8x2"}
BLOCKED_OPS = {INT8: "packed_linear_q8_blocked", INT8X2: "packed_linear_q8x2_blocked"}
STREAMED_OPS = {INT8: "packed_linear_q8_streamed", INT8X2: "packed_linear_q8x2_streamed"}
AMX_OPS = {INT8: "packed_linear_q8_amx", INT8X2: "packed_linear_q8x2_amx"}
WIDE_OPS = {INT8: "packed_linear_q8_wide", INT8X2: "packed_linear_q8x2_wide"}
WIDE_MAX_ROWS = 16  # the wide forms are timed up to this many rows (made for one or a few)
AMX_MAX_ROWS = 16  # the AMX forms are timed up to this many rows (the scratch form and bf16 win more)
AMX_MAX_GROUP = 64  # packed_q8_amx.cpp's AMX_MAX_K: a group's codes are one tile row of x's digits


class PackedCandidate(ABC):
    """One way to compute a packed product. `applies` says for which layers and row counts it is timed; `make`
    builds the kernel for a layer (compiled for `rows` when it compiles), which must compute on any weight of the
    layer's layout passed to it (the timing calls it on copies); `floor_us` is the least time it can take, from the
    times of the candidates timed before it in the same race (kiln.kernels.race)."""

    name: ClassVar[str]
    activations: ClassVar[str] = FLOAT32  # the arithmetic: float32 (dequantize-then-fp32's) or int8
    builds: ClassVar[bool] = False  # make() compiles or repacks: it races after the candidates that build nothing
    second_form: ClassVar[bool] = False  # its kernel holds a copy of each weight (bytes: copy_bytes)
    built_per_rows: ClassVar[bool] = False  # make() builds anew for each row count (compiled for static rows)

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return True

    def floor_us(self, times: dict[str, float], dequant_us: float) -> float:
        """`dequant_us`: the layer's dequantization by torch ops alone (dequant-blas's first part). 0: no bound."""
        return 0.0

    def copy_bytes(self, layer: PackedLinear) -> int:
        """The bytes of the copy a `second_form` kernel holds of this layer's weight."""
        return 0

    @abstractmethod
    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel: ...


class DequantBlas(PackedCandidate):
    name = "dequant-blas"

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        return dequant_blas


class CompiledDequantBlas(PackedCandidate):
    name = "compiled-dequant-blas"
    builds = True

    def floor_us(self, times: dict[str, float], dequant_us: float) -> float:
        """The same BLAS call as dequant-blas after a faster dequantization: at least dequant-blas's BLAS part."""
        return max(0.0, times[DequantBlas.name] - dequant_us) if DequantBlas.name in times else 0.0

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        dequant = dequantizer(layer, compiler)
        return lambda x, c, s, o: nn.functional.linear(x, dequant(c, s, o).view(c.shape[0], -1))


class TiledDequantBlas(PackedCandidate):
    name = "tiled-dequant-blas"
    builds = True  # (no BLAS floor: its BLAS reads tiles still in cache, faster than the whole weight)

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return rows > GEMV_ROWS and layer.out_features > TILE_ROWS

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        return Tiled(layer, compiler)


class FusedReduction(PackedCandidate):
    name = "fused-reduction"
    builds = True
    built_per_rows = True

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return rows <= GEMV_ROWS

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        x = torch.zeros(rows, layer.in_features, dtype=layer.scale.dtype)
        return shared_compile(reduction, compiler, x, *layer_weight(layer))


class Int4PackMM(PackedCandidate):
    name = "int4pack-mm"
    builds = True  # repacks every weight copy it is timed on
    second_form = True

    def copy_bytes(self, layer: PackedLinear) -> int:
        """4-bit codes and a (scale, zero) pair of float32 per group."""
        return layer.out_features * layer.in_features // 2 + layer.scale.numel() * 8

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        """torch's CPU int4 kernel takes 4-bit codes in groups of 32 and float32 or bfloat16 activations."""
        has_op = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        return has_op and layer.bits == 4 and layer.group == 32 and layer.scale.dtype in (torch.float32, torch.bfloat16)

    def __init__(self) -> None:
        self.forms = FormMemo(Int4Packed)  # one repacked copy per race's copies and per layer

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        return cast(Kernel, self.forms(weights))


class BrgemmBf16(PackedCandidate):
    name = "brgemm-bf16"
    activations = BF16
    builds = True  # a bf16 copy of every weight it is timed on
    second_form = True

    def __init__(self) -> None:
        self.forms = FormMemo(Bf16Form)  # one form per race's copies and per layer

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        on_cpu = layer.codes.device.type == "cpu"
        return rows > GEMV_ROWS and on_cpu and layer.in_features % 2 == 0 and brgemm_bf16_op() is not None

    def copy_bytes(self, layer: PackedLinear) -> int:
        return bf16_form_bytes(layer.out_features, layer.in_features)

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        if brgemm_bf16_op() is None:  # chosen on an earlier run but not built now (the build logged why)
            return dequant_blas
        return cast(Kernel, self.forms(weights))


class NativePacked(PackedCandidate):
    name = "native"

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        on_cpu = layer.codes.device.type == "cpu"  # the objects hold CPU kernels only
        return on_cpu and layer.scale.dtype == torch.float32 and native_packed_linear() is not None

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        # chosen on an earlier run but not built now (the build logged why): the reference runs
        return native_packed_linear() or dequant_blas


class NativeInt8(PackedCandidate):
    name = "native-int8"
    activations = INT8
    ops: ClassVar[dict[str, str]] = INT8_OPS  # the native op of each activations' digits
    max_rows: ClassVar[int | None] = None  # timed up to this many rows (None: any)

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        on_cpu = layer.codes.device.type == "cpu"
        fits = layer.group <= INT8_MAX_GROUP and layer.scale.dtype == torch.float32
        within = self.max_rows is None or rows <= self.max_rows
        return within and on_cpu and fits and widest_native(self.ops[self.activations]) is not None

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        # chosen on an earlier run but not built now: the float32 reference runs (the build logged why)
        return widest_native(self.ops[self.activations]) or dequant_blas


class NativeInt8x2(NativeInt8):
    name = "native-int8x2"
    activations = INT8X2


class NativeInt8Blocked(PackedCandidate):
    name = "native-int8-blocked"
    activations = INT8
    ops = BLOCKED_OPS

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return rows > GEMV_ROWS and self.fits(layer)

    def fits(self, layer: PackedLinear) -> bool:
        """The layer's codes can run this form here (any row count)."""
        on_cpu = layer.codes.device.type == "cpu"
        # int8 codes are shifted to unsigned: two digits' sums of a larger group could pass int32
        nibbles = layer.codes.dtype == torch.uint8
        widest = INT8_MAX_GROUP if nibbles or self.activations == INT8 else BLOCKED_MAX_GROUP
        fits = layer.group <= widest and layer.scale.dtype == torch.float32
        # int8 codes run on the AVX-512 VNNI form alone (the AVX2 one would saturate on them)
        op = self.ops[self.activations]
        codes_run = nibbles or native_op("avx512", op) is not None
        return on_cpu and fits and codes_run and widest_native(op) is not None

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        # chosen on an earlier run but not built now: the float32 reference runs (the build logged why)
        return widest_native(self.ops[self.activations]) or dequant_blas


class NativeInt8x2Blocked(NativeInt8Blocked):
    name = "native-int8x2-blocked"
    activations = INT8X2


class NativeInt8Streamed(NativeInt8Blocked):
    name = "native-int8-streamed"
    activations = INT8
    ops = STREAMED_OPS

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        return rows <= STREAMED_MAX_ROWS and self.fits(layer)


class NativeInt8x2Streamed(NativeInt8Streamed):
    name = "native-int8x2-streamed"
    activations = INT8X2


class NativeInt8Wide(NativeInt8):
    """x's digits widened to one int16 each (packed_q8_wide.cpp): the same arithmetic, for one or a few rows."""

    name = "native-int8-wide"
    ops = WIDE_OPS
    max_rows = WIDE_MAX_ROWS


class NativeInt8x2Wide(NativeInt8Wide):
    name = "native-int8x2-wide"
    activations = INT8X2


class NativeInt8Amx(PackedCandidate):
    name = "native-int8-amx"
    activations = INT8

    def applies(self, layer: PackedLinear, rows: int) -> bool:
        """Where the CPU has AMX-INT8 (cpuid's flags) and the op loads; the packed kernel table also drops this
        candidate where its probe in a child process failed (kiln.kernels.compute_forms.amx_int8_works)."""
        on_cpu = layer.codes.device.type == "cpu"
        # a group's codes in whole 16-byte runs, at most one tile row (nibbles: 32 or 64 values, int8: 16 to 64)
        code_bytes = layer.group // 2 if layer.codes.dtype == torch.uint8 else layer.group
        fits = layer.group <= AMX_MAX_GROUP and code_bytes % 16 == 0 and layer.scale.dtype == torch.float32
        runs = amx_int8_present() and native_op("avx512", AMX_OPS[self.activations]) is not None
        return GEMV_ROWS < rows <= AMX_MAX_ROWS and on_cpu and fits and runs

    def make(self, layer: PackedLinear, rows: int, compiler: PieceCompiler, weights: list[Weight]) -> Kernel:
        # chosen on an earlier run but not built now: the float32 reference runs (the build logged why)
        return native_op("avx512", AMX_OPS[self.activations]) or dequant_blas


class NativeInt8x2Amx(NativeInt8Amx):
    name = "native-int8x2-amx"
    activations = INT8X2


def widest_native(name: str) -> Kernel | None:
    """Native op `name` of the widest tier this CPU runs and that builds here (a tier whose build fails gives way
    to the next), None where none does."""
    return next((op for op in (native_op(t.name, name) for t in runnable_tiers()) if op is not None), None)


def native_packed_linear() -> Kernel | None:
    """The native float32-activation op (None where no tier builds)."""
    return widest_native("packed_linear")


def native_int8_linear(activations: str = INT8) -> Kernel | None:
    """The native op for int8 activations of one or two digits (int8 | int8x2), None where no tier builds."""
    return widest_native(INT8_OPS[activations])


def native_blocked_linear(activations: str = INT8) -> Kernel | None:
    """The blocked native op (16 or 8 outputs a vector) for int8 activations of one or two digits, of the widest tier
    that has it (avx512, avx2), None where neither runs or builds."""
    return widest_native(BLOCKED_OPS[activations])


CANDIDATES: dict[str, PackedCandidate] = {
    c.name: c
    for c in (
        DequantBlas(),
        CompiledDequantBlas(),
        TiledDequantBlas(),
        FusedReduction(),
        Int4PackMM(),
        BrgemmBf16(),
        NativePacked(),
        NativeInt8(),
        NativeInt8x2(),
        NativeInt8Blocked(),
        NativeInt8x2Blocked(),
        NativeInt8Streamed(),
        NativeInt8x2Streamed(),
        NativeInt8Wide(),
        NativeInt8x2Wide(),
        NativeInt8Amx(),
        NativeInt8x2Amx(),
    )
}
DEQUANT_BLAS, COMPILED_DEQUANT, TILED = DequantBlas.name, CompiledDequantBlas.name, TiledDequantBlas.name
FUSED, INT4PACK, NATIVE, BRGEMM_BF16 = FusedReduction.name, Int4PackMM.name, NativePacked.name, BrgemmBf16.name
NATIVE_INT8, NATIVE_INT8X2 = NativeInt8.name, NativeInt8x2.name
NATIVE_INT8_BLOCKED, NATIVE_INT8X2_BLOCKED = NativeInt8Blocked.name, NativeInt8x2Blocked.name
NATIVE_INT8_STREAMED, NATIVE_INT8X2_STREAMED = NativeInt8Streamed.name, NativeInt8x2Streamed.name
NATIVE_INT8_WIDE, NATIVE_INT8X2_WIDE = NativeInt8Wide.name, NativeInt8x2Wide.name
NATIVE_INT8_AMX, NATIVE_INT8X2_AMX = NativeInt8Amx.name, NativeInt8x2Amx.name
AMX_CANDIDATES = (NATIVE_INT8_AMX, NATIVE_INT8X2_AMX)


# the arithmetics an engine's activations admit besides float32 (which computes the same product more exactly): its
# own int8 one, and bf16 second forms for int8 engines (approximate too; the bf16 form passes the accuracy bar of
# int8 activations, kiln.kernels.compute_forms)
ADMITS = {FLOAT32: (FLOAT32,), INT8: (FLOAT32, INT8, BF16), INT8X2: (FLOAT32, INT8X2, BF16)}


def candidates_for(activations: str, second_forms: bool = True) -> dict[str, PackedCandidate]:
    """The candidates an engine with these activations may time; those that hold a second form of the weight only
    where the engine allows second forms (a memory budget above zero)."""
    admitted = ADMITS.get(activations, (FLOAT32, activations))
    return {
        name: c for name, c in CANDIDATES.items() if c.activations in admitted and (second_forms or not c.second_form)
    }
