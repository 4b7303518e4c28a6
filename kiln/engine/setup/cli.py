"""Parsers of `kiln generate`, `kiln chat` and `kiln compile` (handlers in kiln.engine.serving.commands)."""

from __future__ import annotations

import argparse

from kiln.engine.setup.args import EngineArgs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_generate_subcommand(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    EngineArgs.add_cli_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(handler="kiln.engine.serving.commands:cmd_generate")


def add_chat_subcommand(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("chat", help="interactive chat, streaming tokens")
    EngineArgs.add_cli_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(handler="kiln.engine.serving.commands:cmd_chat")


def add_compile_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile",
        help="trace, split, compile and capture the model; write pieces, graph.dot, lint, profile, fusion report",
    )
    EngineArgs.add_cli_args(p)
    p.add_argument("--out", required=True, help="directory for the artifacts (pieces/, graph.dot, lint.txt, ...)")
    p.set_defaults(handler="kiln.engine.serving.commands:cmd_compile")
