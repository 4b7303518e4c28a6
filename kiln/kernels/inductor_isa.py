"""Inductor's vector-ISA probe, run at install and replayed at start-up where nothing it depends on changed.

Before its first C++ kernel, inductor checks every vector ISA this CPU's flags name (AMX, AVX-512 VNNI, AVX-512,
AVX2, and features such as AVX-512 BF16) by compiling a small test program with each one's flags and loading it in a
child process: ~8 s of a cold start on a 2-core Sapphire-Rapids-class Xeon, ~5 s on an AVX2-only EPYC, paid again
under every new inductor cache dir. Each answer depends only on the CPU, the C++ compiler inductor runs, torch and the
test program, so `kiln kernels build` (run by `make setup`) runs inductor's probe once in a fresh process, records
each check's answer beside the native kernels (KILN_NATIVE_DIR), and a start whose CPU flags, compiler and torch are
the record's answers inductor's checks from it (`trust_recorded_probe`); a check the record does not hold (another
test program, a new ISA) still compiles, as inductor always does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch._inductor import cpp_builder, cpu_vec_isa

from kiln.env import read_env
from kiln.kernels.native.build import cpu_flags

logger = logging.getLogger("kiln")

RECORD = "inductor_vec_isa.json"
PROBE_TIMEOUT_S = 600


def _machine() -> dict[str, Any]:
    """What the probe's answers depend on besides the test programs: the CPU's flags, the compiler inductor runs
    ($CXX or its default, by name and version) and torch."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    cxx = cpp_builder.get_cpp_compiler()
    version = hashlib.sha256(cpp_builder.get_compiler_version_info(cxx).encode()).hexdigest()[:16]
    return {"cpu_flags": flags, "compiler": f"{cxx} {version}", "torch": torch.__version__}


def _check_key(isa: cpu_vec_isa.VecISA, code: str) -> str:
    """One check: the ISA, the flags it compiles with at that moment (a feature check adds its own), the program."""
    return f"{isa} | {isa.build_arch_flags()} | {hashlib.sha256(code.encode()).hexdigest()[:16]}"


def record_path() -> Path:
    return read_env().native_dir / RECORD


def probe_and_record(path: Path | None = None) -> dict[str, Any]:
    """Run inductor's probe in a fresh process (where nothing answered it yet) and write each check's answer and
    the ISAs that passed to `path` (default: beside the native kernels); the record."""
    path = path or record_path()
    run = subprocess.run(
        [sys.executable, "-m", "kiln.kernels.inductor_isa"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    if run.returncode != 0:
        raise RuntimeError(f"inductor's vector-ISA probe failed: {run.stderr.strip()[-2000:]}")
    record = json.loads(run.stdout.strip().splitlines()[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return record


def _probe() -> dict[str, Any]:
    """Inductor's own probe, each check's answer noted (in a process where it has not run)."""
    checks: dict[str, bool] = {}
    check_build = cpu_vec_isa.VecISA.check_build

    def noted(isa: cpu_vec_isa.VecISA, code: str) -> bool:
        key = _check_key(isa, code)  # before the check: a feature check restores the ISA's flags after it
        checks[key] = bool(check_build(isa, code))
        return checks[key]

    cpu_vec_isa.VecISA.check_build = noted  # type: ignore[method-assign]
    try:
        passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    finally:
        cpu_vec_isa.VecISA.check_build = check_build  # type: ignore[method-assign]
    return {**_machine(), "passed": passed, "checks": checks}


def recorded_checks(path: Path | None = None) -> dict[str, bool] | None:
    """The record's answers where it was made on this CPU, compiler and torch; None where it was not (or there is
    none, or it does not read)."""
    try:
        record = json.loads((path or record_path()).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in _machine().items()):
        return None
    checks = record.get("checks")
    return checks if isinstance(checks, dict) else None


@functools.cache
def trust_recorded_probe() -> bool:
    """Answer inductor's ISA checks from the install-time record where it holds (once per process); whether it
    does. NOTE: wraps inductor's `VecISA.check_build`, the one method its probe compiles through; a check the
    record lacks runs the original."""
    checks = recorded_checks()
    check_build = getattr(cpu_vec_isa.VecISA, "check_build", None)
    if not checks or check_build is None:
        return False

    def answered(isa: cpu_vec_isa.VecISA, code: str) -> bool:
        known = checks.get(_check_key(isa, code))
        return check_build(isa, code) if known is None else bool(known)

    cpu_vec_isa.VecISA.check_build = answered  # type: ignore[method-assign]
    logger.debug("Inductor's vector-ISA checks answered from the install-time probe (%s)", record_path())
    return True


if __name__ == "__main__":  # probe_and_record's fresh process
    print(json.dumps(_probe()))
