"""A `--check` command for bisect tests: fails while piece ARGV[1] is captured in the modes ARGV[2].

It also checks that KILN_PIECE_MODES carries the same modes as the substituted argument.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    piece, spec = int(sys.argv[1]), sys.argv[2]
    if os.environ.get("KILN_PIECE_MODES") != spec:
        print(f"KILN_PIECE_MODES={os.environ.get('KILN_PIECE_MODES')!r} differs from {spec!r}", file=sys.stderr)
        return 2
    modes: dict[int, str] = {}
    for item in spec.split(","):
        span, _, mode = item.partition(":")
        first, _, last = span.partition("-")
        for i in range(int(first), int(last or first) + 1):
            modes[i] = mode
    if modes.get(piece) == "captured":
        print(f"piece {piece} is captured: FAIL", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
