"""One configuration path (kiln.engine.setup.resolve): the environment is read into the config before an engine is
built, never by the compiler or the executors; an `EngineCore` is made in one place, `build_core`."""

from __future__ import annotations

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parents[2] / "kiln"


def _calls(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_compile_and_the_executors_read_no_environment() -> None:
    readers = [
        f"{path.relative_to(KILN.parent)}:{line}"
        for package in ("compile", "executor")
        for path in sorted((KILN / package).rglob("*.py"))
        for line in _calls(path, "read_env")
    ]
    assert readers == [], "resolve the value in kiln.engine.setup.resolve and pass it in the config"


def test_an_engine_core_is_made_only_by_build_core() -> None:
    makers = [
        f"{path.relative_to(KILN.parent)}:{line}"
        for path in sorted(KILN.rglob("*.py"))
        for line in _calls(path, "EngineCore")
    ]
    assert [m.rsplit(":", 1)[0] for m in makers] == ["kiln/engine/setup/build.py"], makers
