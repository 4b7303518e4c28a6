"""`ServerArgs` generates every `kiln serve` flag the hand-written parser had: the same names, defaults, help,
choices, metavars, actions and groups (data/serve_flags_before.json was taken from that parser before it went)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import pytest

from kiln.server.server_args import ServerArgs

BEFORE = json.loads((Path(__file__).parent / "data" / "serve_flags_before.json").read_text())
# NOTE: the value types are the same functions, moved and renamed (kiln.engine.setup.arg_types); str fields now say
# `type=str`, argparse's default
TYPE_NAMES = {None: "str", "_seconds": "seconds"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> dict:
    group = next(g.title for g in parser._action_groups if action in g._group_actions)
    type_name = getattr(action.type, "__name__", None) if action.type else None
    return {
        "flags": action.option_strings,
        "dest": action.dest,
        "default": action.default,
        "metavar": action.metavar,
        "choices": list(action.choices) if action.choices else None,
        "help": action.help,
        "action": type(action).__name__,
        "type": TYPE_NAMES.get(type_name, type_name),
        "group": group,
    }


# flags added since the hand-written parser went (each with its issue)
ADDED_SINCE = {"--allow-runtime-lora-updating": "issue 54: vLLM's runtime LoRA loading, off unless given"}


def test_server_args_generate_every_serve_flag_as_before() -> None:
    parser = _parser()
    rows = [_row(parser, action) for action in parser._actions]
    after = [row for row in rows if not set(row["flags"]) & set(ADDED_SINCE)]
    assert len(rows) - len(after) == len(ADDED_SINCE)
    before = [{**row, "type": TYPE_NAMES.get(row["type"], row["type"])} for row in BEFORE]
    assert [row["flags"] for row in after] == [row["flags"] for row in before]  # every flag, in the same order
    for old, new in zip(before, after, strict=True):
        assert new == old, old["flags"]


def test_group_descriptions_are_kept() -> None:
    described = {g.title: g.description for g in _parser()._action_groups if g.description}
    assert set(described) == {"authentication", "request limits", "structured outputs"}
    assert described["authentication"].startswith("With an API key, /v1/* answers 401")


def test_from_cli_args_reads_every_field() -> None:
    args = _parser().parse_args(["--port", "0", "--max-queue", "3", "--body-timeout", "2.5", "--access-log"])
    server = ServerArgs.from_cli_args(args)
    assert (server.port, server.max_queue, server.body_timeout, server.access_log) == (0, 3, 2.5, True)
    added = {flag.removeprefix("--").replace("-", "_") for flag in ADDED_SINCE}
    assert {f.name for f in fields(ServerArgs)} == {row["dest"] for row in BEFORE} | added


@pytest.mark.parametrize(("flag", "value"), [("--body-timeout", "0"), ("--max-queue", "-1"), ("--port", "x")])
def test_bad_values_are_usage_errors_naming_the_flag(capsys, flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args([flag, value])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
