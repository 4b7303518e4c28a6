"""argparse value types every kiln subcommand shares: a bad value is a usage error naming the flag and what was
expected (light: no torch, as `kiln --help` builds every parser)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, Field
from typing import Any


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return value


def non_negative(text: str) -> float:
    """A number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4); `none` -> ()."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, or none") from None


def cli_flag(f: Field) -> str:
    """The flag of an EngineArgs field: `--max-model-len` for `max_model_len`."""
    return "--" + f.name.replace("_", "-")


def argparse_kwargs(f: Field) -> dict[str, Any]:
    """`add_argument` keywords of an EngineArgs field: its help, default, and action or type."""
    kwargs = dict(f.metadata["argparse"])
    default = f.default if f.default is not MISSING else None
    kwargs.setdefault("help", f.metadata["help"])
    kwargs["default"] = default
    if "action" not in kwargs:
        if isinstance(default, bool):
            kwargs["action"] = "store_true"
        elif "type" not in kwargs:
            kwargs["type"] = _field_type(f)
    return kwargs


def _field_type(f: Field) -> Any:
    kind = str(f.type)
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str
