"""Satisfiability: the success line, minimal unsat cores with lines, redundancy warnings, bounds, Python `//` `%`."""

from __future__ import annotations

import logging

from kiln.recipe import load_recipe
from kiln.recipe.evaluate import evaluate


def constraints(*lines: str) -> str:
    return "input_constraints:\n  constraints:\n" + "".join(f"    - {line}\n" for line in lines)


def test_valid_recipe_logs_success_and_a_witness(header, write, caplog) -> None:
    path = write(
        header
        + constraints(
            "num_tokens <= 2048", "seq_len <= 2048", "batch_size <= 64", "num_tokens % 2 == 0 or num_tokens == 1"
        )
    )
    with caplog.at_level(logging.INFO, logger="kiln"):
        recipe = load_recipe(path)
    assert "Recipe validated: 4 constraints satisfied, 0 conflicts" in caplog.messages
    assert recipe.diagnostics == []
    assert all(evaluate(c.expr, {**recipe.model_values, **recipe.witness}) for c in recipe.constraints)
    assert (recipe.max_num_batched_tokens, recipe.max_num_seqs, recipe.max_model_len) == (2048, 64, 2048)


def test_conflict_reports_the_minimal_core_with_lines(header, write, only_error) -> None:
    path = write(header + constraints("num_tokens <= 2048", "seq_len <= 2048", "batch_size <= 8", "seq_len >= 4096"))
    err = only_error(path)
    assert (err.line, err.col, err.length) == (7, 7, 15)
    assert err.message == "seq_len <= 2048 (line 7) conflicts with seq_len >= 4096 (line 9)"


def test_conflict_through_several_constraints(header, write, only_error) -> None:
    path = write(
        header
        + constraints(
            "seq_len <= 2048",
            "num_tokens <= 2 * batch_size",
            "batch_size <= 4",
            "num_tokens >= 9 and num_tokens <= 100",
        )
    )
    err = only_error(path)
    assert err.message == (
        "num_tokens <= 2 * batch_size (line 7) conflicts with batch_size <= 4 (line 8) and "
        "num_tokens >= 9 and num_tokens <= 100 (line 9)"
    )


def test_conflict_with_the_implicit_bound(header, write, only_error) -> None:
    err = only_error(write(header + constraints("seq_len <= 2048", "num_tokens < 1")))
    assert err.line == 7
    assert err.message == (
        "num_tokens < 1 (line 7) conflicts with the implicit bound num_tokens >= 1 (counts are positive)"
    )


def test_conflict_mentions_model_values(header, write, only_error) -> None:
    err = only_error(write(header + constraints("seq_len <= 2048", "num_tokens <= 100", "num_tokens >= hidden_size")))
    assert err.message == (
        "num_tokens <= 100 (line 7) conflicts with num_tokens >= hidden_size (line 8) (the model has hidden_size=576)"
    )


def test_constant_false_constraint_can_never_hold(header, write, only_error) -> None:
    err = only_error(write(header + constraints("seq_len <= 2048", "1 == 2")))
    assert (err.line, err.message) == (7, "1 == 2 (line 7) can never hold")


def test_implied_constraints_are_warnings(header, write) -> None:
    path = write(
        header
        + constraints(
            "num_tokens <= 2048", "seq_len <= 2048", "num_tokens % 1 == 0", "seq_len <= 4096", "seq_len <= 2048"
        )
    )
    recipe = load_recipe(path)
    found = [(d.severity, d.line, d.col, d.message) for d in recipe.diagnostics]
    assert found == [
        ("warning", 8, 7, "redundant constraint num_tokens % 1 == 0: it is always true"),
        ("warning", 9, 7, "redundant constraint seq_len <= 4096: it is implied by seq_len <= 2048 (line 7)"),
        ("warning", 10, 7, "redundant constraint seq_len <= 2048: it is implied by seq_len <= 2048 (line 7)"),
    ]


def test_python_floor_division_semantics(header, write) -> None:
    # Python: -7 // -2 == 3 and -6 // -2 == 3, so seq_len is 6 or 7 (Z3's Euclidean division would give 5 or 6).
    recipe = load_recipe(write(header + constraints("num_tokens <= 32", "(0 - seq_len) // -2 == 3")))
    assert recipe.max_model_len == 7


def test_python_modulo_semantics(header, write) -> None:
    # Python: 7 % -2 == -1 (sign of the divisor); Z3's mod is never negative, so this would be unsatisfiable.
    recipe = load_recipe(write(header + constraints("num_tokens <= 32", "seq_len <= 9", "seq_len % -2 == -1")))
    assert recipe.max_model_len == 9


def test_division_by_a_zero_model_expression_is_an_error(header, write, only_error) -> None:
    err = only_error(write(header + constraints("seq_len <= 2048", "num_tokens // (num_heads - 9) <= 4")))
    assert (err.line, err.col, err.length) == (7, 22, 13)
    assert err.message == ("division by zero in num_tokens // (num_heads - 9) <= 4: `num_heads - 9` is 0 (num_heads=9)")


def test_unbounded_batch_size_gives_no_limit(header, write) -> None:
    recipe = load_recipe(write(header + constraints("num_tokens <= 64", "seq_len <= 256")))
    assert recipe.max_num_seqs is None
    assert recipe.max_num_batched_tokens == 64
