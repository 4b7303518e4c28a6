"""Native kernels built per ISA tier and loaded where cpuid allows.

A tier is a set of compiler flags and the CPU flags they need. Each tier's object is built once per machine from
the sources beside this file, with `torch.utils.cpp_extension` (OpenMP on, so `at::parallel_for` runs on torch's
thread pool): at install (`kiln kernels build`, which `make setup` runs) into `<KILN_NATIVE_DIR>/<tier>-<key>/`,
or, where no object for this key was installed, on first use into `<cache_dir>/native/<tier>-<key>/`. The key
hashes the sources, the flags, the torch version and the compiler's version: a new torch, compiler or source
builds again, nothing stale is loaded. The build holds a lock of kiln's own (an flock on that folder, released
by the OS when a build is killed); torch's own lock file there, which a killed build leaves behind and which would
make the next build wait forever, is removed under it.

`native_op(tier, name)` is the tier's op `name` (`packed_linear`: float32 activations; `packed_linear_q8` and
`packed_linear_q8x2`: one or two int8 digits; their `_blocked` and `_streamed` forms, avx512 and avx2 tiers: the
same arithmetic with 16 or 8 outputs a vector (codes transposed into a scratch, or in registers), int8 codes on
avx512 only; their `_wide` forms, avx512 and avx2 tiers: the same arithmetic with x's digits widened to one int16
(packed_q8_wide.cpp, for one or a few rows); their `_amx` forms, avx512 tier: the same arithmetic with a group's
integer sums of every row on the matrix unit (packed_q8_amx.cpp; callable only where the CPU has AMX-INT8 and Linux
grants the tiles); `paged_decode_attention`: decode attention over the paged KV cache; `brgemm_bf16_linear`, avx512
tier: a bf16 copy of a weight times x on oneDNN's brgemm ukernel (the matrix unit where there is one, dense_brgemm.cpp);
`prompt_row_scores`: the numbers prompt logprobs keep of each row of logits (row_scores.cpp); `head_row_scores`,
avx512 tier: the same numbers from a bf16 head's brgemm tiles, never writing the logits (head_scores.cpp); `lora_delta`:
the LoRA adapters' products of a decode step's few rows, each token through its own slot (lora.cpp);
`install_lora_dispatch` / `bind_lora`: the C++ CPU kernel of `kiln::packed_linear_lora`, a packed product and the
adapters' products of the LoRA buffers bound to its weight in one call (dispatch.cpp);
`bind_packed` / `install_packed_dispatch`: the C++ CPU kernel of `kiln::packed_linear`, dispatch.cpp, installed by
`install_native_dispatch`; `bind_dense` / `install_dense_dispatch`: that of `kiln::dense_linear`, by
`native_dense_binder`), or None where the CPU lacks the tier, the tier has no such op, or the build failed (no
compiler, a compiler error): kiln then runs on the torch candidates and says why once, in one log line.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.env import read_env
from kiln.kernels.choices import cpu_info
from kiln.quant.ops import ROW_CLASSES, use_native_binder

logger = logging.getLogger("kiln")

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "packed_linear.cpp",
        "packed_q8.cpp",
        "packed_q8_blocked.cpp",
        "packed_q8_wide.cpp",
        "packed_q8_amx.cpp",
        "paged_attention.cpp",
        "dispatch.cpp",
        "dense_brgemm.cpp",
        "row_scores.cpp",
        "head_scores.cpp",
        "lora.cpp",
    )
)
# included by the sources: part of their hash
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "packed_operands.h",
        "q8_activations.h",
        "lora.h",
        "lora_vectors.h",
        "row_math.h",
        "bf16_form.h",
        "kv_rows.h",
    )
)
# -ffp-contract=off: no fused multiply-add the source does not write (the reference rounds op by op)
COMMON_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off")


@dataclass(frozen=True)
class Tier:
    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list for this tier's object to be loaded

    @property
    def namespace(self) -> str:
        return f"kiln_native_{self.name}"


# F16C (every AVX2 CPU has it; GCC's -mavx2 and -mavx512f do not imply it): float16 and fp8 KV rows widen 8 at a time
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *AVX2_FLAGS)
TIERS = (
    Tier(
        "avx512",
        AVX512_FLAGS,
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"}),
    ),
    Tier("avx2", AVX2_FLAGS, frozenset({"avx2", "fma", "f16c"})),
    Tier("plain", (), frozenset()),  # the compiler's baseline for the platform (x86-64: SSE2)
)
TIER_NAMES = tuple(t.name for t in TIERS)


AMX_INT8_FLAGS = frozenset({"amx_tile", "amx_int8"})  # what the `_amx` ops' instructions need of the CPU


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info().get("flags", "").split())


def amx_int8_present() -> bool:
    """Whether cpuid says this CPU has the tiles and int8 tile products the `_amx` ops run on."""
    return cpu_flags() >= AMX_INT8_FLAGS


def runnable_tiers() -> list[Tier]:
    """The tiers whose instructions this CPU has, widest first."""
    flags = cpu_flags()
    return [t for t in TIERS if t.cpu_flags <= flags]


def source_hash() -> str:
    """A hash of the native sources: part of every kernel choice that timed them, so a change times again."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def compiler_version() -> str | None:
    """The first line of `c++ --version` (or $CXX's), None where there is no C++ compiler."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return None
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.splitlines()[0] if result.stdout else cxx


def build_key(tier: Tier, compiler: str) -> str:
    parts = [source_hash(), " ".join((*COMMON_FLAGS, *tier.cflags)), torch.__version__, compiler]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def tier_by_name(name: str) -> Tier:
    return next(t for t in TIERS if t.name == name)


OPS = (
    "packed_linear",
    "packed_linear_q8",
    "packed_linear_q8x2",
    "packed_linear_q8_blocked",
    "packed_linear_q8x2_blocked",
    "packed_linear_q8_streamed",
    "packed_linear_q8x2_streamed",
    "packed_linear_q8_wide",
    "packed_linear_q8x2_wide",
    "packed_linear_q8_amx",
    "packed_linear_q8x2_amx",
    "paged_decode_attention",
    "paged_prefill_attention",
    "bind_packed",
    "install_packed_dispatch",
    "bind_dense",
    "install_dense_dispatch",
    "brgemm_bf16_linear",
    "prompt_row_scores",
    "head_row_scores",
    "lora_delta",
    "install_lora_dispatch",
    "bind_lora",
)
# ops only some tiers define (the blocked and streamed products: zmm and ymm forms, none in the plain tier) or run
# (oneDNN's bf16 brgemm needs AVX-512: every tier's object has the op, the avx512 tier's alone is looked up)
TIER_OPS = {name: ("avx512", "avx2") for name in OPS if name.endswith(("_blocked", "_streamed", "_wide"))}
TIER_OPS["brgemm_bf16_linear"] = TIER_OPS["head_row_scores"] = ("avx512",)
TIER_OPS |= {"packed_linear_q8_amx": ("avx512",), "packed_linear_q8x2_amx": ("avx512",)}  # AMX-INT8 tiles


def native_op(tier_name: str, name: str = "packed_linear") -> Callable[..., torch.Tensor] | None:
    """The tier's op `name` (built or read from the cache, then loaded), None where it cannot run here or the tier
    has no such op (TIER_OPS)."""
    if name not in OPS:
        raise ValueError(f"no native op {name!r}; the native ops are {', '.join(OPS)}")
    if tier_name not in TIER_OPS.get(name, (tier_name,)) or not _loaded(tier_name):
        return None
    return getattr(getattr(torch.ops, tier_by_name(tier_name).namespace), name)


@functools.cache
def _loaded(tier_name: str) -> bool:
    """Whether the tier's object is loaded in this process (built first where it is not in the cache)."""
    tier = tier_by_name(tier_name)
    if tier not in runnable_tiers():
        return False
    compiler = compiler_version()
    if compiler is None:
        _say_once(
            "native kernels are off: no C++ compiler (c++ or $CXX) on this machine; packed products run on "
            "the torch candidates"
        )
        return False
    try:
        _load(tier, compiler)
    except Exception as exc:  # a compiler's error, a missing header: the torch candidates still run
        logger.warning(
            "Native kernels (%s) could not be built, packed products run without them: %s",
            tier.name,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__,
        )
        return False
    return True


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


def _object(tier: Tier, compiler: str) -> Path:
    """The tier's object for this compiler, torch and sources, relative to a folder of native objects."""
    key = build_key(tier, compiler)
    return Path(f"{tier.name}-{key}") / f"{tier.namespace}_{key}.so"


def installed_path(tier: Tier, compiler: str) -> Path:
    """Where `kiln kernels build` (run by `make setup`) puts the tier's object: KILN_NATIVE_DIR."""
    return read_env().native_dir / _object(tier, compiler)


def library_path(tier: Tier, compiler: str) -> Path:
    """The tier's object this process loads: the one built at install where it is there, else the one built (or
    to be built) in the cache."""
    installed = installed_path(tier, compiler)
    return installed if installed.is_file() else read_env().cache_dir / "native" / _object(tier, compiler)


def install_tier(tier: Tier) -> Path:
    """Build the tier's object into KILN_NATIVE_DIR (where it is not there yet) and load it; its path. Raises
    RuntimeError where there is no compiler, OSError where the folder cannot be written, the compiler's error."""
    compiler = compiler_version()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or $CXX) on this machine")
    library = installed_path(tier, compiler)
    _build_or_load(tier, compiler, library)
    return library


def _load(tier: Tier, compiler: str) -> None:
    _build_or_load(tier, compiler, library_path(tier, compiler))


def _build_or_load(tier: Tier, compiler: str, library: Path) -> None:
    from torch.utils import cpp_extension

    folder, name = library.parent, library.stem
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process building the same object: wait for it, then load its
        if not library.exists():
            (folder / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed build: stale under our lock
            logger.info("Building native kernels (%s tier, %s) ...", tier.name, compiler)
            started = time.perf_counter()
            cpp_extension.load(
                name,
                [str(p) for p in SOURCES],
                extra_cflags=[*COMMON_FLAGS, *tier.cflags, f"-DKILN_TIER_NS={tier.namespace}"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
            logger.info(
                "Built native kernels (%s tier) in %.1f s: %s", tier.name, time.perf_counter() - started, library
            )
            return  # cpp_extension.load loaded it
    finally:
        os.close(fd)
    torch.ops.load_library(str(library))


@functools.cache
def native_dense_binder() -> Callable[..., None] | None:
    """`bind_dense` of the widest tier that loads, with `kiln::dense_linear`'s C++ CPU kernel (dispatch.cpp)
    installed, once per process (the op must be defined: kiln.kernels.dense calls this); None where no tier loads
    (the op keeps its Python implementation)."""
    for tier in runnable_tiers():
        install, bind = native_op(tier.name, "install_dense_dispatch"), native_op(tier.name, "bind_dense")
        if install is not None and bind is not None:
            install(list(ROW_CLASSES))
            return bind
    return None


@functools.cache
def install_native_dispatch() -> str | None:
    """Make `kiln::packed_linear`'s CPU kernel the C++ one (dispatch.cpp) of the widest tier that loads, once per
    process, and send every binding there too (kiln.quant.ops.use_native_binder); the tier's name, None where no
    tier loads (the op keeps its Python implementation)."""
    for tier in runnable_tiers():
        install, bind = native_op(tier.name, "install_packed_dispatch"), native_op(tier.name, "bind_packed")
        if install is None or bind is None:
            continue
        install(list(ROW_CLASSES))
        use_native_binder(bind)
        return tier.name
    return None
