"""The normalized recipe hash: stable across formatting, comments and key order; changes with any value."""

from __future__ import annotations

import pytest

from kiln.recipe import load_recipe_text

BASE = """\
recipe_version: 1
model: {name: smollm2, path: default}
weights: {dtype: float32, source_quantization: q4_1}
input_constraints:
  constraints: [num_tokens <= 2048, seq_len <= 2048]
graph: {mode: full_and_piecewise, capture_sizes: [1, 2, 4]}
hardware: {device: cpu}
"""

REFORMATTED = """\
# the same recipe, written differently
graph:
  capture_sizes:
    - 1
    - 2
    - 4          # comments do not matter
  mode: full_and_piecewise
input_constraints:
  constraints:
    - "num_tokens<=2048"
    - (seq_len) <= 2048
weights: {source_quantization: q4_1, dtype: float32}
model:
  path: default
  name: smollm2
recipe_version: 1
hardware: {device: cpu, arch: null}   # a default written out
"""


def hash_of(text: str) -> str:
    return load_recipe_text(text).hash


def test_hash_ignores_formatting_comments_and_key_order() -> None:
    assert hash_of(BASE) == hash_of(REFORMATTED)
    assert len(hash_of(BASE)) == 64


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("name: smollm2", "name: smollm2-b"),
        ("seq_len <= 2048", "seq_len <= 2047"),
        ("capture_sizes: [1, 2, 4]", "capture_sizes: [1, 2, 8]"),
        ("mode: full_and_piecewise", "mode: full"),
        ("dtype: float32,", "dtype: bfloat16,"),
    ],
)
def test_hash_changes_with_any_value(old: str, new: str) -> None:
    changed = BASE.replace(old, new)
    assert changed != BASE
    assert hash_of(changed) != hash_of(BASE)
