"""Parsers of `kiln debug diff | bisect | save-case | check-case | explain` (handlers in kiln.debug.commands).

- accuracy drift: `diff` (which boundary first leaves the noise floor), `bisect` (which pieces' mode causes it)
- capture failure: `bisect` tells a capture/replay fault from a miscompile; KILN_DEBUG=1 checks replay addresses
- compile failure: `explain` (graph breaks and trace failures with module path, op, source line and a hint)
- regressions: `save-case` / `check-case` (exit 1 naming the boundary); cases run under pytest too; a case saved
  with `--lora` records the adapter and replays it

Every subcommand takes the engine flags `EngineArgs` defines (`--seed` also seeds a random prompt for models
without a tokenizer).
"""

from __future__ import annotations

import argparse

from kiln.engine.setup.args import EngineArgs

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_NUM_DECODE = 4
_HANDLERS = "kiln.debug.commands"


def add_debug_subcommand(sub: argparse._SubParsersAction) -> None:
    debug = sub.add_parser("debug", help="graph-mode debugger: diff, bisect, save-case, check-case, explain")
    cmds = debug.add_subparsers(dest="debug_command", required=True)

    d = cmds.add_parser("diff", help="eager vs graph mode per boundary; reports the first divergence")
    EngineArgs.add_cli_args(d)
    _add_run_args(d)
    d.add_argument("--case", default=None, help="take inputs, reference and thresholds from a saved debug case")
    _add_lora_arg(d)
    d.add_argument(
        "--modes",
        default="eager,captured",
        help="REFERENCE,TEST paths: eager (the model), traced (pieces eager), compiled, captured",
    )
    d.set_defaults(handler=f"{_HANDLERS}:cmd_diff")

    b = cmds.add_parser("bisect", help="find the minimal set of pieces whose graph mode causes a failure")
    EngineArgs.add_cli_args(b)
    _add_run_args(b)
    how = b.add_mutually_exclusive_group()
    how.add_argument("--case", default=None, help="the failure: this debug case regresses")
    how.add_argument(
        "--check", default=None, help="the failure: CMD exits non-zero ({piece_modes} in CMD is substituted)"
    )
    _add_lora_arg(b)
    b.set_defaults(handler=f"{_HANDLERS}:cmd_bisect")

    s = cmds.add_parser("save-case", help="save inputs, expected outputs and per-boundary thresholds as a case")
    EngineArgs.add_cli_args(s)
    _add_run_args(s)
    s.add_argument("--out", required=True, help="directory to write case.json and tensors.safetensors into")
    s.add_argument("--mode", default="captured", help="the path the case tests (compiled, captured)")
    _add_lora_arg(s)
    s.set_defaults(handler=f"{_HANDLERS}:cmd_save_case")

    c = cmds.add_parser(
        "check-case",
        help="replay a debug case; exit 1 naming the first regressed boundary (engine flags left at their "
        "defaults take the case's values; a case saved with --lora replays that adapter, its files checked)",
    )
    EngineArgs.add_cli_args(c)
    c.add_argument("case_dir", help="a directory written by `kiln debug save-case`")
    c.add_argument("--mode", default=None, help="path to test (default: the case's)")
    c.add_argument("--inject-fault", action="append", default=[], help="layer=K:mlp | piece=K:stale-input")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(handler=f"{_HANDLERS}:cmd_check_case")

    e = cmds.add_parser("explain", help="list graph breaks and trace failures with module path, op and a hint")
    EngineArgs.add_cli_args(e)
    e.set_defaults(handler=f"{_HANDLERS}:cmd_explain")


def _add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora",
        default=None,
        metavar="NAME=PATH",
        help="run the request with this LoRA adapter (a PEFT directory; turns --enable-lora on): every path runs it",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    p.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 1,2,3 (models without a tokenizer)")
    p.add_argument("--num-decode", type=int, default=DEFAULT_NUM_DECODE, help="decode steps after the prefill")
    p.add_argument(
        "--cached-prefix",
        type=int,
        default=0,
        help="the prompt's first N tokens (whole KV blocks) come from the prefix cache, primed by an earlier "
        "request: every path prefills only the rest over that cached context",
    )
    p.add_argument("--inject-fault", action="append", default=[], help="layer=K:mlp | piece=K:stale-input")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
