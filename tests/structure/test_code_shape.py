"""How the code reads: no squeezing. Few `# fmt: skip`, no function over 80 lines, keywords for long calls.

The rule for calls (STYLE.md, principle 3): a call that passes five or more arguments by position must pass them
by keyword instead. Exempt, because the callee is not kiln's and its arguments read by position:

- a callee whose dotted root is a name the module imports from outside kiln (`torch.ops.kiln.moe(...)`,
  `F.linear(...)`, `np.zeros(...)`): torch ops follow their schema, and a custom op's schema is positional;
- `functools.partial(f, a, b, ...)` counts as a call of `f` with the arguments after `f`;
- a logging call (`logger.info("%s %s", ...)`, any receiver): its arguments fill a %-format;
- `"...".format(...)`: its arguments fill the braces;
- a method whose name is a `torch.Tensor` method (`x.view(a, b, c, d, e)`): a shape reads by position;
- the calls listed in `FOREIGN_CALLEES` by file and callee, each with its reason.

Every other call, kiln's own functions and classes included, is checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
KILN = ROOT / "kiln"

MAX_FMT_SKIPS = 2
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL_ARGS = 4

LOGGING_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
TENSOR_METHODS = {name for name in dir(torch.Tensor) if not name.startswith("_")}

# (file, callee as written) -> why its arguments stay positional.
FOREIGN_CALLEES = {
    ("kiln/kernels/attention.py", "self.op"): "a torch.ops handle of the native tier; its schema is positional",
    ("kiln/bench/report.py", "table.add_row"): "rich's Table: one cell per column, in the columns' order",
}


def _files() -> list[Path]:
    return sorted(KILN.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _foreign_roots(tree: ast.Module) -> set[str]:
    """Names bound by imports from outside kiln, anywhere in the module."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("kiln")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("kiln"):
            roots |= {a.asname or a.name for a in node.names}
    return roots


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _positional(call: ast.Call) -> tuple[ast.expr, list[ast.expr]]:
    """The callee and its positional arguments (a partial's: the function and what is bound to it)."""
    func, args = call.func, [a for a in call.args if not isinstance(a, ast.Starred)]
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name == "partial" and call.args:
        return call.args[0], args[1:]
    return func, args


def _exempt(path: str, func: ast.expr, foreign: set[str]) -> bool:
    callee = ast.unparse(func)
    if (path, callee) in FOREIGN_CALLEES or _root(func) in foreign:
        return True
    if isinstance(func, ast.Attribute):
        return func.attr in LOGGING_METHODS or func.attr == "format" or func.attr in TENSOR_METHODS
    return False


def long_positional_calls(path: Path) -> list[tuple[int, str, int]]:
    """(line, callee, number of positional arguments) for each call the rule forbids in one file."""
    tree = ast.parse(path.read_text())
    foreign, rel, found = _foreign_roots(tree), _rel(path), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, args = _positional(node)
        if len(args) > MAX_POSITIONAL_ARGS and not _exempt(rel, func, foreign):
            found.append((node.lineno, ast.unparse(func), len(args)))
    return sorted(found)


def test_fmt_skip_is_rare() -> None:
    skips = [
        f"{_rel(path)}:{i}"
        for path in _files()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*skip", line)
    ]
    assert len(skips) <= MAX_FMT_SKIPS, (
        f"{len(skips)} '# fmt: skip' in kiln/ (at most {MAX_FMT_SKIPS}, for tables that read "
        f"better aligned); let ruff format the rest: {skips}"
    )


def test_no_function_over_80_lines() -> None:
    long = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines; split them by step: {long}"


def test_long_calls_use_keywords() -> None:
    found = [
        f"{_rel(path)}:{line} {callee}(...) with {count} positional arguments"
        for path in _files()
        for line, callee, count in long_positional_calls(path)
    ]
    assert not found, f"pass five or more arguments by keyword (or list a foreign callee with its reason): {found}"


def test_the_call_rule_sees_what_it_should(tmp_path: Path) -> None:
    """The checker itself: kiln calls are caught; torch, logging, format, shapes and small partials are not."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import functools\nimport torch\nfrom kiln.x import make\n"
        "make(1, 2, 3, 4, 5)\n"
        "self.build(1, 2, 3, 4, 5)\n"
        "functools.partial(make, 1, 2, 3, 4, 5)\n"
        "functools.partial(make, 1, 2, 3, 4)\n"
        "torch.ops.kiln.moe(1, 2, 3, 4, 5)\n"
        "logger.info('%s %s %s %s', 1, 2, 3, 4)\n"
        "'{}{}{}{}{}'.format(1, 2, 3, 4, 5)\n"
        "x.view(1, 2, 3, 4, 5)\n"
        "make(1, 2, 3, 4, e=5)\n"
    )
    found = long_positional_calls(source)
    assert [(line, callee) for line, callee, _ in found] == [(4, "make"), (5, "self.build"), (6, "make")]


def test_allow_list_is_not_stale() -> None:
    """A callee no longer called where FOREIGN_CALLEES says: remove its entry."""
    for path, callee in FOREIGN_CALLEES:
        assert f"{callee}(" in (ROOT / path).read_text(), f"FOREIGN_CALLEES: {path} no longer calls {callee}"
