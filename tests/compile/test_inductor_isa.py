"""Inductor's vector-ISA probe recorded at install (kiln.kernels.inductor_isa): replayed only where it was made on this
CPU, compiler and torch, and then inductor picks the ISA (and its features) its own probe picks, compiling nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch._inductor import cpu_vec_isa

from kiln.kernels import inductor_isa

PICK = """
import json, sys
from torch._inductor import cpu_vec_isa
def no_probe(self, code):
    raise AssertionError(f"inductor compiled a check of {self}")
if sys.argv[1] == "replayed":
    cpu_vec_isa.VecISA.check_build = no_probe
from kiln.kernels.inductor_isa import trust_recorded_probe
told = trust_recorded_probe()
isa = cpu_vec_isa.pick_vec_isa()
state = {k: v for k, v in vars(isa).items() if isinstance(v, (bool, str))}
print(json.dumps({"told": told, "isa": str(isa), "state": state}))
"""


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("native") / inductor_isa.RECORD
    inductor_isa.probe_and_record(path)
    return path


def _pick(native_dir: Path, mode: str) -> dict:
    env = {**os.environ, "KILN_NATIVE_DIR": str(native_dir)}
    run = subprocess.run([sys.executable, "-c", PICK, mode], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _rewritten(record: Path, tmp_path: Path, **change: object) -> Path:
    changed = tmp_path / "native" / inductor_isa.RECORD
    changed.parent.mkdir()
    changed.write_text(json.dumps({**json.loads(record.read_text()), **change}))
    return changed


def test_the_record_holds_inductors_answers(record: Path) -> None:
    saved = json.loads(record.read_text())
    assert saved["passed"] == [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    assert inductor_isa.recorded_checks(record) == saved["checks"]
    flagged = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list]
    # every ISA that passed was checked (an ISA this CPU lacks is filtered out by its flags, unchecked)
    assert all(any(key.startswith(f"{isa} |") for key in saved["checks"]) for isa in saved["passed"])
    assert set(saved["passed"]) <= set(flagged)


def test_a_start_with_the_record_picks_inductors_isa_compiling_nothing(record: Path, tmp_path: Path) -> None:
    """In the "replayed" process any check inductor would compile raises; it picks what its own probe picks in a
    process without the record, with the same features (AVX-512 BF16, AMX FP16) found."""
    assert json.loads(record.read_text())["passed"]  # x86-64 CPUs kiln runs on have AVX2 at least
    replayed = _pick(record.parent, "replayed")
    probed = _pick(tmp_path / "no-record", "probed")
    assert replayed == {**probed, "told": True}
    assert probed["told"] is False


def test_a_check_that_failed_at_install_drops_its_isa(record: Path, tmp_path: Path) -> None:
    """Replayed answers are the record's, not a guess: the widest ISA's checks recorded as failed, inductor takes the
    next one, still compiling nothing."""
    saved = json.loads(record.read_text())
    widest, rest = saved["passed"][0], saved["passed"][1:]
    checks = {key: ok and not key.startswith(f"{widest} |") for key, ok in saved["checks"].items()}
    changed = _rewritten(record, tmp_path, checks=checks)
    assert _pick(changed.parent, "replayed")["isa"] == (rest[0] if rest else str(cpu_vec_isa.invalid_vec_isa))


@pytest.mark.parametrize(
    "change",
    [{"compiler": "clang++ 0123456789abcdef"}, {"torch": "2.0.0"}, {"cpu_flags": "0000000000000000"}],
    ids=["compiler", "torch", "cpu"],
)
def test_a_record_made_elsewhere_is_not_replayed(record: Path, tmp_path: Path, change: dict) -> None:
    assert not inductor_isa.recorded_checks(_rewritten(record, tmp_path, **change))


def test_a_missing_or_malformed_record_is_not_replayed(tmp_path: Path) -> None:
    assert inductor_isa.recorded_checks(tmp_path / inductor_isa.RECORD) is None
    (tmp_path / inductor_isa.RECORD).write_text("{not json")
    assert inductor_isa.recorded_checks(tmp_path / inductor_isa.RECORD) is None
    assert _pick(tmp_path, "probed")["told"] is False
