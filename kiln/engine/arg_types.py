"""argparse value types every kiln subcommand shares: a bad value is a usage error naming the flag and what was
expected (light: no torch, as `kiln --help` builds every parser)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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


def parse_sizes(text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4); `none` -> ()."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, or none") from None
