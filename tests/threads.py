"""A test's helper thread whose failure fails the test: what the target raised is kept and raised again on join."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CheckedThread(threading.Thread):
    """Runs `target(*args)`; `join_checked` waits for it and raises an AssertionError naming what it raised (an
    assert in the target included), or that it is still running. A plain thread's failure only reaches pytest as
    a warning, and only if the warning filter lets it through (pyproject.toml makes it an error as well)."""

    def __init__(self, target: Callable[..., object], args: tuple[Any, ...] = (), daemon: bool = True) -> None:
        super().__init__(name=getattr(target, "__name__", "helper"), daemon=daemon)
        self.call = target
        self.call_args = args
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.call(*self.call_args)
        except BaseException as exc:  # NOTE: kept for join_checked, which raises it in the test's own thread
            self.error = exc

    def join_checked(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"thread {self.name} still running after {timeout} s"
        if self.error is not None:
            raise AssertionError(f"thread {self.name} failed: {self.error!r}") from self.error
