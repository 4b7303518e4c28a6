"""The debugger makes its engines as every entry point does: through `kiln.engine.setup.build.build_core`, with a
config resolved for the model (no hand-built `EngineCore`)."""

from __future__ import annotations

from typing import Any

import pytest

import kiln.debug.session as session_module
from kiln.debug.session import EAGER, DebugSession
from kiln.executor.eager import EagerExecutor
from tests.debug.conftest import NUM_DECODE, PROMPT, tiny_options


def test_the_debugger_builds_every_engine_through_build_core(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = session_module.build_core

    def spy(config: Any, model: Any, **kwargs: Any) -> Any:
        engine = real(config, model, **kwargs)
        built.append(engine.executor.name)
        return engine

    monkeypatch.setattr(session_module, "build_core", spy)
    session = DebugSession.open(tiny_options())
    assert built == ["graph"]  # the session's engine over the factory model
    session.run(EAGER, PROMPT, NUM_DECODE)
    assert built == ["graph", "eager"]  # its eager reference engine, over the same model
    eager = session._eager_engines[EAGER]
    assert isinstance(eager.executor, EagerExecutor) and eager.model is session.model
    for engine in (session.engine, eager):
        config = engine.config
        assert config.max_model_len == engine.max_model_len and config.graph.max_model_len == config.max_model_len
        assert config.quantization == "none"  # "auto" over a model with no checkpoint blocks
