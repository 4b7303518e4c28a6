"""A failure inside a test's thread fails the test: through pytest's warning filter (pyproject.toml) and through
CheckedThread, which thread helpers in tests use so that the test itself asserts on what its threads saw."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.threads import CheckedThread

ROOT = Path(__file__).resolve().parents[2]


def test_an_assert_in_a_plain_thread_fails_its_test_under_the_projects_warning_filters(tmp_path: Path) -> None:
    toy = tmp_path / "test_toy.py"
    toy.write_text(
        textwrap.dedent("""
            import threading

            def test_thread_fails():
                thread = threading.Thread(target=lambda: (_ for _ in ()).throw(AssertionError("canary got 500")))
                thread.start()
                thread.join()

            def test_a_user_warning_is_still_ignored():
                import warnings
                warnings.warn("noisy library", UserWarning)
        """)
    )
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *config, str(toy)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert "PytestUnhandledThreadExceptionWarning" in run.stdout and "canary got 500" in run.stdout, run.stdout


def test_a_checked_thread_raises_its_failure_on_join() -> None:
    def canary() -> None:
        assert 500 == 200, "canary got 500"

    thread = CheckedThread(canary)
    thread.start()
    with pytest.raises(AssertionError, match=r"thread canary failed.*canary got 500"):
        thread.join_checked(10)


def test_a_checked_thread_that_does_not_end_fails_the_join() -> None:
    release = threading.Event()
    stuck = CheckedThread(release.wait)
    stuck.start()
    with pytest.raises(AssertionError, match="still running"):
        stuck.join_checked(0.05)
    release.set()
    stuck.join_checked(10)
