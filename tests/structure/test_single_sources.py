"""Facts stated once: the row classes live in kiln.quant.ops.ROW_CLASSES, and the rest reads them from there.

The native dispatch (kiln/kernels/native/dispatch.cpp) is handed them at install; the kernel tables time them
(kiln.kernels.packed, kiln.kernels.dense); README states them for readers and is checked against them here.
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln.quant.ops import ENTRIES, LARGE, ROW_CLASSES, row_class, rows_label

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "kiln" / "quant" / "ops.py"


def _spelled() -> list[str]:
    """The row classes as prose writes them: "1", "2", "3-6", ..., "257+"."""
    labels = [rows_label(top).removesuffix(" rows").removesuffix(" row") for top in ROW_CLASSES]
    return [*labels, f"{ROW_CLASSES[-1] + 1}+"]


def test_the_spelling_follows_the_table() -> None:
    spelled = _spelled()
    assert len(spelled) == len(ENTRIES) and spelled[0] == "1" and spelled[-1].endswith("+")
    for top, label in zip(ROW_CLASSES[1:], spelled[1:-1], strict=True):  # each class starts after the one before
        first = int(label.split("-")[0])
        assert row_class(first) == top and row_class(first - 1) != top
    assert row_class(ROW_CLASSES[-1] + 1) == LARGE


def test_no_other_source_states_the_row_classes() -> None:
    """Ranges such as "7-16" or a tuple "6, 16, 64, 256" outside kiln/quant/ops.py would be a second statement."""
    ranges = [label for label in _spelled() if "-" in label or "+" in label]
    patterns = [re.compile(rf"(?<![\d.-]){re.escape(label)}(?![\d-])") for label in ranges]
    patterns.append(re.compile(re.escape(", ".join(str(top) for top in ROW_CLASSES[2:]))))
    found = []
    for path in sorted((ROOT / "kiln").rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h") or path == HOME:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{i}: {p.pattern}" for p in patterns if p.search(line)]
    assert not found, f"the row classes are stated in kiln.quant.ops.ROW_CLASSES; refer to it instead: {found}"


def test_the_native_dispatch_is_handed_the_row_classes() -> None:
    """The C++ side keeps no table of its own: its install ops take the row classes as an argument."""
    source = (ROOT / "kiln" / "kernels" / "native" / "dispatch.cpp").read_text()
    for op in ("install_packed_dispatch", "install_dense_dispatch"):
        assert f"{op}(int[] row_classes)" in source


def test_readme_states_the_row_classes_of_the_table() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    spelled = _spelled()
    assert f"{', '.join(spelled[:-1])} and {spelled[-1]}" in readme
