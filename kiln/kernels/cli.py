"""Parser of `kiln kernels` (handlers in kiln.kernels.commands): `kiln kernels build` builds the native kernels
at install, so a first start does not (`make setup` runs it); `kiln kernels forget` drops this CPU's timed
choices so the next start times them again."""

from __future__ import annotations

import argparse


def add_kernels_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="kiln's kernels: build the native ones at install, forget timed choices")
    verbs = p.add_subparsers(dest="verb", required=True)
    b = verbs.add_parser(
        "build",
        help="build the native kernels of the widest ISA tier this CPU runs into KILN_NATIVE_DIR "
        "(default <environment>/share/kiln/native)",
    )
    b.add_argument("--all-tiers", action="store_true", help="every tier this CPU runs, not only the widest")
    b.set_defaults(handler="kiln.kernels.commands:cmd_build")
    f = verbs.add_parser(
        "forget",
        help="drop the kernel choices timed on this CPU from the cache, so the next start times them again "
        "(after a first start that other work slowed down)",
    )
    # NOTE: its own destination: engine flags (EngineArgs) belong to the commands that build an engine
    f.add_argument(
        "--cache-dir",
        dest="choices_dir",
        default=None,
        help="the cache whose choices to drop (default: KILN_CACHE_DIR)",
    )
    f.set_defaults(handler="kiln.kernels.commands:cmd_forget")
