"""Every flag of `kiln serve`'s own (each ServerArgs field EngineArgs lacks) acts or is refused (issue 53, item 6): a
walk over the fields shows each one changing what `kiln serve` builds from its flags (the app's settings, the engine
front's queue, the connection limits, the HTTP server's config; over a FakeCore, no model, nothing bound) in a
setting where it applies, and each flag that would do nothing beside the others is refused with a message naming it
and why. The engine's flags have their own walk (tests/engine/test_inert_options.py)."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError
from kiln.launch import build_parser
from kiln.server.launcher import check_server_args, http_server
from kiln.server.server_args import ServerArgs
from tests.server.app_harness import build_served_app
from tests.server.fake_core import FakeCore

RECIPE = """\
recipe_version: 1
model: {name: smollm2-135m-instruct}
weights: {source_quantization: q4_1}
input_constraints:
  constraints: [seq_len <= 1024, num_tokens <= 32]
hardware: {device: cpu}
"""
SERVE_ONLY = sorted({f.name for f in fields(ServerArgs)} - {f.name for f in fields(EngineArgs)})
KEY = ["--api-key", "walk-key"]
KEY_FILE = "KEY_FILE"  # replaced by a file holding a key

# each flag: its value (no words for a switch), and the other flags that make a setting where it acts
ACTS: dict[str, tuple[list[str], list[str]]] = {
    "host": (["0.0.0.0"], []),
    "allowed_hosts": (["kiln.example"], []),
    "port": (["8123"], []),
    "served_model_name": (["walk"], []),
    "shutdown_timeout": (["3"], []),
    "access_log": ([], []),
    "completion_special_tokens": (["text"], []),
    "tool_call_parser": (["hermes"], []),
    "reasoning_parser": (["qwen3"], []),
    "allow_runtime_lora_updating": ([], ["--enable-lora"]),
    "api_key": (["walk-key"], []),
    "api_key_file": ([KEY_FILE], []),
    "metrics_auth": ([], KEY),
    "body_timeout": (["2"], []),
    "header_timeout": (["3"], []),
    "keep_alive_timeout": (["2"], []),
    "max_connections": (["10"], []),
    "max_connections_per_peer": (["3"], []),
    "max_body_bytes": (["4096"], []),
    "max_prompt_chars": (["100"], []),
    "max_seqs_per_request": (["8"], []),
    "max_stop_strings": (["2"], []),
    "max_stop_chars": (["8"], []),
    "max_queue": (["5"], []),
    "max_stream_buffer": (["16"], []),
    "max_grammar_bytes": (["1000"], []),
    "max_grammar_choices": (["10"], []),
    "max_schema_depth": (["4"], []),
    "grammar_compile_timeout": (["2"], []),
    "grammar_compile_threads": (["3"], []),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def built(argv: list[str]) -> dict[str, Any]:
    """What `kiln serve ARGV` builds from its flags over a FakeCore whose engine config the engine flags resolve:
    the app's settings, the engine front's bounds, the connection limits and the HTTP server's config."""
    args = build_parser().parse_args(argv)
    core = FakeCore()
    core.config = replace(core.config, lora=resolve_engine_config(EngineArgs.from_cli_args(args)).lora)
    app = build_served_app(core, argv)
    server, engine, table = http_server(app, args), app.state.engine, app.state.connections
    http = server.config
    return {
        "settings": app.state.settings,
        "engine": (engine.max_queue, engine.max_buffered_outputs),
        "connections": (table.max_connections, table.max_per_peer),
        "http": (http.host, http.port, http.timeout_keep_alive, http.http.header_timeout, http.access_log),
        "shutdown": (http.timeout_graceful_shutdown, server.shutdown_timeout),
    }


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "key.txt"
    path.write_text("from-a-file\n")
    return path


def test_the_walk_names_every_serve_flag() -> None:
    assert sorted(ACTS) == SERVE_ONLY


@pytest.mark.parametrize("name", SERVE_ONLY)
def test_every_serve_flag_changes_what_is_built_where_it_applies(name: str, key_file: Path) -> None:
    value, context = ACTS[name]
    value = [str(key_file) if word == KEY_FILE else word for word in value]
    assert built([*context, flag(name), *value]) != built(context)


def test_the_probe_sees_no_change_in_flags_given_their_defaults() -> None:
    """The walk's comparison can fail: flags given at their defaults build the same server."""
    defaults = {f.name: f.default for f in fields(ServerArgs)}
    argv = ["--port", str(defaults["port"]), "--max-queue", str(defaults["max_queue"]), "--host", defaults["host"]]
    assert built(argv) == built([])


REFUSED: dict[str, tuple[list[str], str]] = {
    "allowed hosts beside an API key": ([*KEY, "--allowed-hosts", "a.example"], "--allowed-hosts does nothing beside"),
    "runtime adapters without LoRA": (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating does nothing"),
    "stop string length without stop strings": (
        ["--max-stop-strings", "0", "--max-stop-chars", "8"],
        "--max-stop-chars does nothing with --max-stop-strings 0",
    ),
    "a keep-alive past the header deadline": (
        ["--keep-alive-timeout", "30"],
        "--keep-alive-timeout 30 does nothing at or above --header-timeout 10",
    ),
    "a keep-alive at a lowered header deadline": (
        ["--header-timeout", "3", "--keep-alive-timeout", "3"],
        "--keep-alive-timeout 3 does nothing at or above --header-timeout 3",
    ),
    "metrics auth without a key": (["--metrics-auth"], "--metrics-auth needs an API key"),
    "two API key sources": ([*KEY, "--api-key-file", "/nonexistent"], "both --api-key and --api-key-file"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_serve_flag_that_would_do_nothing_is_refused_by_name(case: str) -> None:
    argv, named = REFUSED[case]
    with pytest.raises(ConfigError, match=named):
        built(argv)


def test_a_recipes_lora_section_lets_runtime_adapters_act(tmp_path: Path) -> None:
    """LoRA comes from --enable-lora or a recipe's lora section: `--allow-runtime-lora-updating` is checked against
    the engine config they resolve to, not the flag alone."""
    args = build_parser().parse_args(["--allow-runtime-lora-updating"])
    plain, with_lora = tmp_path / "plain.yaml", tmp_path / "lora.yaml"
    plain.write_text(RECIPE)
    with_lora.write_text(RECIPE + "lora: {max_loras: 1}\n")
    check_server_args(args, None, resolve_engine_config(EngineArgs(recipe=str(with_lora))))
    with pytest.raises(ConfigError, match="--allow-runtime-lora-updating does nothing without --enable-lora"):
        check_server_args(args, None, resolve_engine_config(EngineArgs(recipe=str(plain))))
