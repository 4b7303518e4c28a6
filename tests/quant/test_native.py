"""kiln's native kernels (kiln.kernels.native): every ISA tier this CPU runs computes the packed product of every
packed GGUF type at 1 to 100 rows as dequantize-then-float32 does; a tier the CPU lacks is never loaded; the AVX2
object holds no AVX-512 instruction; the build is cached by its key, an object built at install is loaded without
a build, and a missing compiler leaves kiln on the torch candidates."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.cli import main
from kiln.kernels.candidates import CANDIDATES, NATIVE
from kiln.kernels.native import build
from kiln.kernels.native.build import TIERS, native_op, runnable_tiers
from kiln.quant.gguf_blocks import PACKED_TYPES
from kiln.quant.linear import PackedLinear
from tests.quant.test_packed import _packed

RUNNABLE = [t.name for t in runnable_tiers()]


def built_library(tier: str) -> Path:
    assert native_op(tier) is not None, f"the {tier} tier runs on this CPU, so it must build and load"
    library = build.library_path(build.tier_by_name(tier), build.compiler_version() or "")
    assert library.is_file()
    return library


def test_this_cpu_runs_the_plain_tier_and_avx2_and_avx512_where_cpuid_says_so() -> None:
    flags = build.cpu_flags()
    assert "plain" in RUNNABLE
    assert ("avx2" in RUNNABLE) == ({"avx2", "fma", "f16c"} <= flags)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"}
    assert ("avx512" in RUNNABLE) == (avx512 <= flags)


@pytest.mark.parametrize("tier", RUNNABLE)
@pytest.mark.parametrize("kind", list(PACKED_TYPES), ids=lambda k: k.name)
def test_every_tier_matches_dequantize_then_float32(tier: str, kind: GGMLQuantizationType) -> None:
    op = native_op(tier)
    assert op is not None, f"the {tier} tier runs on this CPU, so it must build and load"
    out_features, in_features = 72, 512  # 72 outputs: whole tiles of 16 and of 4, and a remainder of 8
    weight = _packed(kind, out_features, in_features, int(kind))
    dense = weight.dequantize().double()
    for rows in (1, 2, 7, 32, 100):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        got = op(x, weight.codes, weight.scale, weight.offset)
        ref = (x.double() @ dense.t()).float()
        assert got.shape == (rows, out_features)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("tier", RUNNABLE)
def test_odd_outputs_and_rows_and_strided_x(tier: str) -> None:
    """Remainders of every tile (37 outputs, 3 and 5 rows) and a non-contiguous x give the same products."""
    op = native_op(tier)
    assert op is not None
    weight = _packed(GGMLQuantizationType.Q4_1, 37, 96, 5)
    dense = weight.dequantize()
    for rows in (3, 5):
        x = torch.randn(96, rows).t()  # a transposed view
        torch.testing.assert_close(
            op(x, weight.codes, weight.scale, weight.offset), x @ dense.t(), rtol=1e-4, atol=1e-4
        )


def test_bad_operands_are_clear_errors() -> None:
    op = native_op(RUNNABLE[0])
    assert op is not None
    weight = _packed(GGMLQuantizationType.Q8_0, 8, 64, 1)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        op(torch.randn(1, 32), weight.codes, weight.scale, weight.offset)
    with pytest.raises(RuntimeError, match="x must be \\[rows, in\\] float32"):
        op(torch.randn(1, 64, dtype=torch.bfloat16), weight.codes, weight.scale, weight.offset)


def test_the_avx2_object_has_no_avx512_instruction() -> None:
    assert shutil.which("objdump"), "objdump comes with binutils, which the C++ compiler needs anyway"
    # the AVX2 object is only built where it can run; elsewhere the plain one is checked
    tier = build.tier_by_name("avx2" if "avx2" in RUNNABLE else "plain")
    library = built_library(tier.name)
    listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "packed_linear" in listing and "packed_linear_q8" in listing
    assert "zmm" not in listing and "{k" not in listing  # no 512-bit register, no AVX-512 mask
    if tier.name == "plain":
        assert "ymm" not in listing  # nor AVX's 256-bit registers in the baseline object


def test_a_tier_the_cpu_lacks_is_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2"}))
    assert [t.name for t in runnable_tiers()] == ["plain"]
    build._loaded.cache_clear()
    try:
        assert native_op("avx2") is None
    finally:
        build._loaded.cache_clear()


def test_the_build_key_follows_sources_flags_torch_and_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2, plain = build.tier_by_name("avx2"), TIERS[-1]
    key = build.build_key(avx2, "g++ 12")
    assert key != build.build_key(plain, "g++ 12") and key != build.build_key(avx2, "g++ 13")
    monkeypatch.setattr(build, "source_hash", lambda: "another source")
    assert build.build_key(avx2, "g++ 12") != key
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert build.build_key(avx2, "g++ 12") != key


def test_without_a_compiler_kiln_says_so_once_and_times_the_torch_candidates(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setattr(build, "compiler_version", lambda: None)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # nothing built in this cache
    build._loaded.cache_clear()
    build._say_once.cache_clear()
    layer = PackedLinear(64, 32, bits=4)
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            assert all(native_op(t.name) is None for t in runnable_tiers())
            assert not CANDIDATES[NATIVE].applies(layer, 1)
        assert caplog.text.count("native kernels are off: no C++ compiler") == 1
        assert not list(tmp_path.glob("native/*/*.so"))
    finally:
        build._loaded.cache_clear()
        build._say_once.cache_clear()


def test_the_op_computes_on_torch_threads() -> None:
    """Built with OpenMP (at::parallel_for on torch's pool, not silently one thread): the object needs libgomp,
    and the result does not depend on the thread count (each output has one owner)."""
    tier = build.tier_by_name(RUNNABLE[0])
    op = native_op(tier.name)
    assert op is not None
    library = built_library(tier.name)
    needed = subprocess.run(["objdump", "-p", str(library)], capture_output=True, text=True, check=True).stdout
    assert "libgomp" in needed
    weight = _packed(GGMLQuantizationType.Q4_0, 256, 128, 7)
    x = torch.randn(4, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, weight.codes, weight.scale, weight.offset)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(op(x, weight.codes, weight.scale, weight.offset), one)
    finally:
        torch.set_num_threads(threads)
    assert np.isfinite(one.numpy()).all()


def test_an_object_built_at_install_is_loaded_without_a_build(tmp_path: Path) -> None:
    """`kiln kernels build` (make setup) puts the widest tier's object in KILN_NATIVE_DIR; a process whose cache has
    none loads that one and builds nothing (a first start does not pay the ~20 s build)."""
    tier = build.tier_by_name(RUNNABLE[0])
    compiler = build.compiler_version() or ""
    built = built_library(tier.name)
    installed = tmp_path / "native" / built.parent.name / built.name
    installed.parent.mkdir(parents=True)
    shutil.copy(built, installed)
    check = (
        "from kiln.kernels.native import build; "
        f"tier = build.tier_by_name({tier.name!r}); "
        f"assert build.native_op(tier.name) is not None; print(build.library_path(tier, {compiler!r}))"
    )
    env = {**os.environ, "KILN_NATIVE_DIR": str(tmp_path / "native"), "KILN_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(installed)
    assert "Building native kernels" not in run.stderr
    assert not list((tmp_path / "cache").glob("native/*/*.so"))


def test_kernels_build_without_a_compiler_says_so_and_succeeds(
    monkeypatch: pytest.MonkeyPatch, kiln_log: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """`make setup` on a machine without a C++ compiler still sets kiln up: the command says native kernels are off
    and exits 0, writing nothing."""
    monkeypatch.setattr(build, "compiler_version", lambda: None)
    monkeypatch.setenv("KILN_NATIVE_DIR", str(tmp_path))
    assert main(["kernels", "build"]) == 0
    assert "Native kernels are off: no C++ compiler" in kiln_log.text
    assert not list(tmp_path.iterdir())


def test_kernels_build_names_a_folder_it_cannot_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KILN_NATIVE_DIR", str(tmp_path / "file" / "native"))  # under a file: never a folder
    assert main(["kernels", "build"]) == 1
    err = capsys.readouterr().err
    assert "kiln: error: cannot write the native kernels to" in err and "KILN_NATIVE_DIR" in err
