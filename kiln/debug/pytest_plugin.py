"""Collect debug cases as pytest tests: every `case.json` under the paths pytest is given becomes one test.

Enable with `pytest -p kiln.debug.pytest_plugin DIR`, or import `pytest_collect_file` in a conftest.py. A case
passes when every boundary of its path under test stays within the saved threshold; a failure names the first
boundary that does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.debug.cases import CASE_FILE, check_names, load_case
from kiln.debug.diff import run_diff
from kiln.debug.session import DebugSession


class CaseRegression(AssertionError):
    """A debug case's path under test left a boundary's threshold."""


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.name == CASE_FILE:
        return DebugCaseFile.from_parent(parent, path=file_path)
    return None


class DebugCaseFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        yield DebugCaseItem.from_parent(self, name=self.path.parent.name)


class DebugCaseItem(pytest.Item):
    def runtest(self) -> None:
        case = load_case(self.path.parent)
        session = DebugSession.open(case.engine_args(), lora=case.lora_request())
        check_names(case, session)
        report = run_diff(session, case.reference, case.test_mode)
        first = report.first_divergence
        if first is not None:
            raise CaseRegression(
                f"debug case {self.path.parent}: regression at boundary {first.name} ({first.module}, piece "
                f"{first.piece}): rel_diff {first.rel_diff:.3g} > threshold {first.threshold:.3g}"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CaseRegression):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"debug case {self.path.parent.name}"
