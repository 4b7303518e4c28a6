"""One configuration path: `EngineArgs` makes every engine subcommand's flags and the `EngineConfig`."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import kiln.recipe.recipe as recipe_module
from kiln import cli, launch
from kiln.config import EngineConfig
from kiln.engine.serving.llm import LLM
from kiln.engine.setup.arg_types import cli_flag
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config, resolve_for_model
from kiln.env import read_env
from kiln.errors import ConfigError
from kiln.recipe import RecipeError

RECIPE = "recipes/smollm2-135m.yaml"
# the subcommands that build an engine; every other one (recipe, loadtest) takes no engine flag
ENGINE_COMMANDS = {
    "generate",
    "chat",
    "serve",
    "bench",
    "compile",
    "debug diff",
    "debug bisect",
    "debug save-case",
    "debug check-case",
    "debug explain",
}
RECIPE_INIT_LORA = {"--enable-lora", "--max-loras", "--max-lora-rank", "--lora-dtype"}


def _leaf_parsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix.strip(): parser}
    out = {}
    for name, child in subs[0].choices.items():
        out.update(_leaf_parsers(child, f"{prefix} {name}"))
    return out


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_every_engine_subcommand_accepts_exactly_the_engine_args_flags() -> None:
    reference = argparse.ArgumentParser(add_help=False)
    EngineArgs.add_cli_args(reference)
    want = _options(reference)
    assert set(want) == {cli_flag(f) for f in fields(EngineArgs)} | {
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--no-normalize-embeddings",
    }
    names = {f.name for f in fields(EngineArgs)}
    leaves = _leaf_parsers(cli.build_parser())
    leaves["python -m kiln.launch"] = launch.build_parser()
    assert set(leaves) >= ENGINE_COMMANDS
    for name, parser in leaves.items():
        options = _options(parser)
        engine_flags = {flag for flag, action in options.items() if action.dest in names}
        engine_flags.discard("--model-path")  # kiln.launch: the seed's name for --model, the same destination
        if name not in ENGINE_COMMANDS | {"python -m kiln.launch"}:
            # loadtest's --model is a served model id, recipe's a checkpoint to check against: no engine flags;
            # `recipe init` names the lora: section's sizes as serve's LoRA flags (they write the recipe)
            written = RECIPE_INIT_LORA if name.endswith("recipe init") else set()
            assert engine_flags <= {"--model", "--seed"} | written, name
            continue
        assert engine_flags == set(want), (name, sorted(engine_flags ^ set(want)))
        for flag, action in want.items():
            got = options[flag]
            assert (got.dest, got.default, got.help, got.choices) == (
                action.dest,
                action.default,
                action.help,
                action.choices,
            ), (name, flag)


def test_flags_parse_into_the_config() -> None:
    argv = ["generate", "--prompt", "x", "--capture-sizes", "1,4", "--compile-sizes", "none", "--compiler", "eager"]
    argv += ["--max-num-seqs", "3", "--no-enable-chunked-prefill", "--enable-piecewise-graph", "--seed", "7"]
    config = resolve_engine_config(EngineArgs.from_cli_args(cli.build_parser().parse_args(argv)))
    assert config.graph_mode.is_graph and config.executor == "graph" and config.seed == 7
    assert (
        config.graph.capture_sizes == (1, 4) and config.graph.compile_sizes == () and config.graph.compiler == "eager"
    )
    assert config.scheduler.max_num_seqs == 3 and not config.scheduler.enable_chunked_prefill
    quiet = replace(read_env(), num_threads=None, debug=0)  # an environment that sets nothing of the engine's
    assert resolve_engine_config(EngineArgs(), env=quiet) == EngineConfig()  # the defaults agree
    assert resolve_engine_config(EngineArgs()).executor == "graph"  # graph mode is the default
    assert resolve_engine_config(EngineArgs(graph_mode="eager")).executor == "eager"


def test_bad_flag_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["generate", "--prompt", "x", "--capture-sizes", "1,two"])
    assert exc.value.code == 2
    assert "--capture-sizes: '1,two': expected comma-separated integers, or none" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"compile sizes \[3\] are not capture sizes"):
        resolve_engine_config(EngineArgs(capture_sizes=(1, 2), compile_sizes=(3,)))


def test_llm_rejects_an_unknown_option_by_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine options \['capture_size'\]"):
        LLM(capture_size=[1])


def test_the_recipe_is_loaded_and_overlaid_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    real = recipe_module.load_recipe
    monkeypatch.setattr(recipe_module, "load_recipe", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    with caplog.at_level(logging.INFO, logger="kiln"):
        config = resolve_engine_config(EngineArgs(recipe=RECIPE, compiler="eager", max_num_seqs=4))
    assert calls == [RECIPE]
    assert config.recipe is not None and config.recipe.path.endswith("smollm2-135m.yaml")
    assert config.graph.compiler == "eager"  # an explicit flag wins over the recipe, and says so
    assert "overrides the recipe's" in caplog.text
    assert config.cache.num_blocks == config.recipe.max_pages and config.scheduler.max_num_seqs == 4
    assert config.graph.recipe_hash == config.recipe.hash


def test_a_broken_recipe_is_reported_before_anything_loads(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe_version: 1\nmodel: {name: m, path: default}\ngraph: {compiler: tvm}\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml:3"):
        resolve_engine_config(EngineArgs(recipe=str(bad)))


def test_a_flag_wins_over_the_environment_which_wins_over_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment's part of the one precedence (kiln.engine.setup.resolve): read once, into the config, so
    nothing below (compile, executors) reads it."""
    monkeypatch.setenv("KILN_CACHE_DIR", "/tmp/kiln-env-cache")
    monkeypatch.setenv("KILN_NUM_THREADS", "3")
    monkeypatch.setenv("KILN_DEBUG", "1")
    config = resolve_engine_config(EngineArgs())
    assert (config.graph.cache_dir, config.num_threads, config.graph.debug) == ("/tmp/kiln-env-cache", 3, 1)
    config = resolve_engine_config(EngineArgs(cache_dir="/tmp/kiln-flag-cache", num_threads=2))
    assert (config.graph.cache_dir, config.num_threads) == ("/tmp/kiln-flag-cache", 2)
    for var in ("KILN_CACHE_DIR", "KILN_NUM_THREADS", "KILN_DEBUG"):
        monkeypatch.delenv(var)
    config = resolve_engine_config(EngineArgs())
    assert config.graph.cache_dir == str(Path.home() / ".cache" / "kiln")
    assert (config.num_threads, config.graph.debug) == (None, 0)


def test_what_the_checkpoint_decides_is_resolved_once_before_the_engine_is_built() -> None:
    """max_model_len (the graph settings' too) and quantization auto are decided with the checkpoint open
    (`resolve_for_model`, called by build_core); a flag's value is kept, and a resolved config stays as it is."""

    def gguf_with_blocks(asked: str) -> str:  # kiln.model.build.run_quantization over a Q4_1 GGUF
        return "packed" if asked == "auto" else asked

    given = resolve_engine_config(EngineArgs())
    assert (given.max_model_len, given.quantization) == (None, "auto")
    long_context = SimpleNamespace(max_position_embeddings=32768)
    packed = resolve_for_model(given, long_context, gguf_with_blocks)
    assert (packed.max_model_len, packed.graph.max_model_len, packed.quantization) == (8192, 8192, "packed")
    assert resolve_for_model(packed, long_context) == packed
    short = resolve_for_model(given, SimpleNamespace(max_position_embeddings=2048))  # no checkpoint: auto is none
    assert (short.max_model_len, short.graph.max_model_len, short.quantization) == (2048, 2048, "none")
    flags = resolve_engine_config(EngineArgs(max_model_len=512, quantization="int8"))
    narrow = resolve_for_model(flags, long_context, gguf_with_blocks)
    assert (narrow.max_model_len, narrow.graph.max_model_len, narrow.quantization) == (512, 512, "int8")
