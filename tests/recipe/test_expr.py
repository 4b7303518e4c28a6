"""The constraint language: the whitelist, exact error positions, and Python semantics in the evaluator and Z3."""

from __future__ import annotations

import os

import pytest
import z3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.recipe.evaluate import evaluate
from kiln.recipe.expr import SYMBOLS, ExprError, parse_constraint
from kiln.recipe.z3_encode import encode

ACCEPTED = [
    "num_tokens <= 2048",
    "1 <= batch_size <= num_tokens < 4096",
    "not (seq_len % 16 == 0) or seq_len // 16 >= 2",
    "max(num_tokens, batch_size) - min(seq_len, 3, -1) != +5 * -2",
    "(hidden_size // num_heads == head_dim) and num_kv_heads > 0",
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_whitelist_accepts(text: str) -> None:
    assert parse_constraint(text).symbols <= set(SYMBOLS)


@pytest.mark.parametrize(
    ("text", "offset", "length", "message"),
    [
        ("batch_size % 4 = 0", 15, 1, "'=' assigns; use '==' to compare: `batch_size % 4 == 0`"),
        ("num_tokns <= 2048", 0, 9, "unknown symbol 'num_tokns'; did you mean 'num_tokens'?"),
        ("seq_len / 2 <= 8", 8, 1, "'/' is true division; use '//' for integer division"),
        ("seq_len ** 2 <= 8", 8, 2, "'**' is not supported; write the product out with '*'"),
        ("seq_len <= 2.5", 11, 3, "only integer literals are allowed, found 2.5"),
        ("seq_len <", 8, 1, "syntax error: the constraint ends too early"),
        ("seq_len + 1", 0, 11, "`seq_len + 1` is a number, not a condition; compare it, e.g. `seq_len + 1 <= 2048`"),
        ("seq_len in 5", 0, 12, "'in' is not allowed; compare with == != < <= > >="),
        ("(seq_len < 3) + 1 > 0", 1, 11, "'+' needs numbers, found a condition: `seq_len < 3`"),
        ("seq_len < 3 and 4", 16, 1, "'and' joins conditions, found a number: `4`"),
        (
            "seq_len.real < 3",
            0,
            12,
            "attribute access not allowed in a constraint; allowed: names, integers, "
            "+ - * // %, comparisons, and/or/not, min/max, parentheses",
        ),
        ("len(seq_len) < 3", 0, 3, "calls are not allowed (found `len(...)`); only min(...) and max(...)"),
        ("min(seq_len) < 3", 0, 12, "min() takes two or more numbers, e.g. min(num_tokens, 2048)"),
    ],
)
def test_whitelist_rejects_with_position(text: str, offset: int, length: int, message: str) -> None:
    with pytest.raises(ExprError) as info:
        parse_constraint(text)
    assert (info.value.offset, info.value.length, info.value.message) == (offset, length, message)


def test_seed_bug_assignment_is_caught_with_its_line(header, write, only_error) -> None:
    path = write(header + "input_constraints:\n  constraints:\n    - seq_len <= 2048\n    - batch_size % 4 = 0\n")
    err = only_error(path)
    assert (err.line, err.col) == (7, 22)
    assert err.format().splitlines() == [
        "recipe.yaml:7:22: error: '=' assigns; use '==' to compare: `batch_size % 4 == 0`",
        "    - batch_size % 4 = 0",
        "                     ^",
    ]


def test_unknown_symbol_caret_underlines_the_name(header, write, only_error) -> None:
    path = write(header + 'input_constraints:\n  constraints: ["seq_len <= 8", "num_tokns <= 2048"]\n')
    err = only_error(path)
    assert (err.line, err.col, err.length) == (5, 34, 9)
    assert err.format().splitlines()[-1] == " " * 33 + "^" + "~" * 8


def test_code_is_never_run(header, write, only_error, tmp_path) -> None:
    target = tmp_path / "pwned"
    path = write(header + f"input_constraints:\n  constraints:\n    - __import__('os').system('touch {target}') == 0\n")
    err = only_error(path)
    assert (err.line, err.col) == (6, 7)
    assert err.message.startswith("calls are not allowed (found `__import__('os').system(...)`)")
    assert not os.path.exists(target)


@pytest.mark.parametrize(
    ("text", "values", "expected"),
    [
        ("seq_len // -2 == -4", {"seq_len": 7}, True),  # Python floors: 7 // -2 == -4
        ("seq_len % -2 == -1", {"seq_len": 7}, True),  # sign of the divisor
        ("-seq_len // 2 == -4", {"seq_len": 7}, True),
        ("-seq_len % 3 == 2", {"seq_len": 7}, True),
        ("1 < seq_len < 3", {"seq_len": 3}, False),
        ("batch_size == 0 or num_tokens % batch_size == 0", {"batch_size": 0, "num_tokens": 5}, True),
    ],
)
def test_evaluator_uses_python_semantics(text: str, values: dict[str, int], expected: bool) -> None:
    assert evaluate(parse_constraint(text), values) is expected


def test_evaluator_reports_division_by_zero() -> None:
    with pytest.raises(ExprError, match="division by zero: `batch_size` is 0"):
        evaluate(parse_constraint("num_tokens % batch_size == 0"), {"num_tokens": 3, "batch_size": 0})


# --- property tests -------------------------------------------------------------------------------------------

NAMES = ("num_tokens", "batch_size", "seq_len")


@st.composite
def int_exprs(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 3 or draw(st.booleans()):
        return draw(st.sampled_from([*NAMES, *[str(n) for n in range(-4, 9)]]))
    kind = draw(st.sampled_from(["bin", "neg", "call"]))
    if kind == "neg":
        return f"-({draw(int_exprs(depth + 1))})"
    if kind == "call":
        fn = draw(st.sampled_from(["min", "max"]))
        return f"{fn}({draw(int_exprs(depth + 1))}, {draw(int_exprs(depth + 1))})"
    op = draw(st.sampled_from(["+", "-", "*", "//", "%"]))
    return f"({draw(int_exprs(depth + 1))} {op} {draw(int_exprs(depth + 1))})"


@st.composite
def bool_exprs(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 2 or draw(st.booleans()):
        ops = draw(st.lists(st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), min_size=1, max_size=2))
        parts = [draw(int_exprs())]
        for op in ops:
            parts += [op, draw(int_exprs())]
        return " ".join(parts)
    kind = draw(st.sampled_from(["and", "or", "not"]))
    if kind == "not":
        return f"not ({draw(bool_exprs(depth + 1))})"
    return f"({draw(bool_exprs(depth + 1))}) {kind} ({draw(bool_exprs(depth + 1))})"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bool_exprs(), st.fixed_dictionaries({n: st.integers(-20, 20) for n in NAMES}))
def test_z3_encoding_matches_python(text: str, values: dict[str, int]) -> None:
    """The Z3 formula holds exactly when the evaluator returns True without a division by zero."""
    expr = parse_constraint(text)
    try:
        expected = evaluate(expr, values)
    except ExprError:
        expected = False
    encoded = encode(expr, {n: z3.IntVal(v) for n, v in values.items()})
    solver = z3.Solver()
    solver.add(*encoded.axioms)
    solver.add(encoded.formula if expected else z3.Not(encoded.formula))
    assert solver.check() == z3.sat
    solver = z3.Solver()
    solver.add(*encoded.axioms)
    solver.add(z3.Not(encoded.formula) if expected else encoded.formula)
    assert solver.check() == z3.unsat


TOKENS = [
    *NAMES,
    "hidden_size",
    "foo",
    "0",
    "7",
    "-",
    "+",
    "*",
    "//",
    "/",
    "%",
    "**",
    "(",
    ")",
    "<",
    "<=",
    "==",
    "=",
    "!=",
    "and",
    "or",
    "not",
    "min",
    "max",
    ",",
    ".",
    "[",
    "]",
    "'s'",
    "1.5",
    "lambda",
    ":",
    "if",
    "else",
    "__import__",
    "True",
    "\\",
    "\n",
    "#",
    "é",
]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.lists(st.sampled_from(TOKENS), max_size=12).map(" ".join), st.text(max_size=40)))
def test_random_text_is_accepted_or_rejected_cleanly(text: str) -> None:
    try:
        expr = parse_constraint(text)
    except ExprError as exc:
        assert 0 <= exc.offset <= max(len(text), 1) and exc.length >= 1
        return
    values = {n: 3 for n in SYMBOLS}
    try:
        assert isinstance(evaluate(expr, values), bool)
    except ExprError as exc:
        assert "division by zero" in exc.message
