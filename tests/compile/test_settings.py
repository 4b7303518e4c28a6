"""Graph settings: recipe -> GraphConfig, CLI overrides (logged), piece-mode syntax."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kiln.compile.modes import PieceMode, format_piece_modes, parse_piece_modes
from kiln.compile.settings import graph_config_from
from kiln.config import FusionGroupConfig, GraphConfig
from kiln.errors import ConfigError

RECIPE = SimpleNamespace(
    piecewise=True,
    splitting_ops=["kiln.attention"],
    capture_sizes=[1, 4, 16],
    compiler="eager",
    hash="sha256:ABC",
    fusion_groups=[SimpleNamespace(name="mlp_fusion", ops=["gate_proj", "silu"])],
)


def test_defaults_without_recipe() -> None:
    config = graph_config_from()
    assert config == GraphConfig()
    assert config.capture_sizes == (1, 2, 4, 8, 16, 32)
    assert config.compiler == "inductor"


def test_recipe_then_logged_overrides(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        config = graph_config_from(RECIPE, compiler="inductor", capture_sizes=None, piece_modes="0-1:eager,3:compiled")
    assert config.capture_sizes == (1, 4, 16)
    assert config.compiler == "inductor"
    assert config.recipe_hash == "sha256:ABC"
    assert config.fusion_groups == (FusionGroupConfig("mlp_fusion", ("gate_proj", "silu")),)
    assert config.piece_modes == ((0, "eager"), (1, "eager"), (3, "compiled"))
    assert "compiler=inductor overrides the recipe's eager" in caplog.text


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="graph compiler 'tvm'"):
        graph_config_from(compiler="tvm")
    with pytest.raises(ConfigError, match="positive integers"):
        graph_config_from(capture_sizes=[0, 2])
    with pytest.raises(ConfigError, match="unknown graph settings"):
        graph_config_from(capture_size=[2])


def test_piece_mode_syntax_round_trips() -> None:
    modes = parse_piece_modes("0-3:captured, 4:eager,5-6:compiled")
    assert modes[0] is PieceMode.CAPTURED and modes[4] is PieceMode.EAGER and modes[6] is PieceMode.COMPILED
    assert format_piece_modes(modes) == "0-3:captured,4:eager,5-6:compiled"
    assert parse_piece_modes({2: "eager"}) == {2: PieceMode.EAGER}
    for bad, message in [("0-3", "INDEX:MODE"), ("1:fast", "expected one of"), ("3-1:eager", "FIRST <= LAST")]:
        with pytest.raises(ConfigError, match=message):
            parse_piece_modes(bad)


def test_recipe_debug_mode_turns_on_trace_level() -> None:
    assert graph_config_from(RECIPE).debug == 0
    assert graph_config_from(SimpleNamespace(**{**vars(RECIPE), "debug_mode": True})).debug == 1
