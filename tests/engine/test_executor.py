"""Executors own how the forward runs: the eager executor's timed layouts, the runner's KV geometry, teacher
forcing through EngineCore."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kiln.kernels.plan as plan_module
from kiln.config import CacheConfig, EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import RequestError
from kiln.executor.eager import EagerExecutor
from kiln.kernels.attention import native_kernels
from kiln.kernels.layout import COLUMN_MAJOR, ROW_MAJOR, is_column_major
from kiln.model.forward_context import ModelInputs
from tests.compile.tiny import make_runner, prefill_metadata, tiny_model


def _layer_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.weight for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.usefixtures("fresh_kernel_choices")
@pytest.mark.parametrize("winner", [ROW_MAJOR, COLUMN_MAJOR])
def test_eager_keeps_the_layout_its_timing_chose(monkeypatch: pytest.MonkeyPatch, winner: str) -> None:
    """Whichever layout the timing says is faster is the one the weights end up in; the numbers do not change."""
    record = {"winner": winner, "times_us": {ROW_MAJOR: 1.0, COLUMN_MAJOR: 1.0}, "source": "timed"}
    monkeypatch.setattr(plan_module, "fastest_one_row_layout", lambda w, cache: record)
    head = (lambda w, cache: (w.detach().t().contiguous(), record)) if winner == COLUMN_MAJOR else None
    monkeypatch.setattr(plan_module, "one_row_head", head or (lambda w, cache: (None, record)))
    model = tiny_model(num_layers=2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    hidden = torch.randn(3, model.config.hidden_size)
    want = model.compute_logits(hidden)
    want_two = model.compute_logits(hidden[0::2])  # BLAS need not sum 2 rows bit for bit as it sums 3
    executor = EagerExecutor()
    make_runner(model, executor)
    assert all(is_column_major(w) == (winner == COLUMN_MAJOR) for w in _layer_weights(model))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    torch.testing.assert_close(executor.compute_logits(hidden, [1]), want[1:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(executor.compute_logits(hidden, [0, 2]), want_two, rtol=0, atol=0)
    assert set(executor.kernel_choices) == {"decoder_layout", "lm_head", "decode_attention", "prefill_attention"}


@pytest.mark.usefixtures("fresh_kernel_choices")
def test_eager_timing_runs_on_this_machine(tmp_path: Path) -> None:
    model = tiny_model(num_layers=1)
    executor = EagerExecutor(cache_dir=str(tmp_path))
    make_runner(model, executor)
    layouts = {"decoder_layout", "lm_head"}
    for name in layouts:
        record = executor.kernel_choices[name]
        times = record["times_us"]
        assert record["source"] == "timed" and set(times) == {ROW_MAJOR, COLUMN_MAJOR}
        assert all(t > 0 for t in times.values()) and record["winner"] == min(times, key=times.__getitem__)
    assert set(executor.kernel_choices) == {*layouts, "decode_attention", "prefill_attention"}
    for kind in ("decode", "prefill"):  # timed too where a native kernel runs (the torch form)
        attention = executor.kernel_choices[f"{kind}_attention"]
        assert getattr(executor.plan, f"{kind}_attention") == attention["winner"]
        runs = native_kernels(torch.float32, f"paged_{kind}_attention")
        assert attention["source"] == "timed" if runs else "no native kernel" in attention["why"]
    column_major = executor.kernel_choices["decoder_layout"]["winner"] == COLUMN_MAJOR
    assert all(is_column_major(w) == column_major for w in _layer_weights(model))


def test_keep_layout_changes_nothing() -> None:
    model = tiny_model(num_layers=1)
    strides = [w.stride() for w in _layer_weights(model)]
    executor = EagerExecutor(keep_layout=True)
    make_runner(model, executor)
    assert [w.stride() for w in _layer_weights(model)] == strides and executor.kernel_choices == {}


def test_runner_kv_geometry_is_named() -> None:
    model = tiny_model(num_layers=2)  # 2 KV heads: the head-major cache's dim 1, never the block count
    runner = make_runner(model)
    assert runner.num_kv_blocks == 64 and runner.block_size == 4
    assert runner.kv_caches[0].shape[1] == model.config.num_kv_heads == 2


def test_runner_forward_returns_every_fed_row() -> None:
    model = tiny_model(num_layers=2)
    runner = make_runner(model)
    meta = prefill_metadata(5)
    hidden = runner.forward(ModelInputs(torch.arange(5), torch.arange(5), meta, [4], ["r"]))
    assert hidden.shape == (5, model.config.hidden_size)


def test_teacher_forcing_feeds_the_forced_tokens() -> None:
    model = tiny_model(num_layers=2)
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32))
    engine = EngineCore(config, model, None, EagerExecutor(keep_layout=True)).prepare()
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("free", [1, 2, 3], greedy)
    while engine.has_unfinished:
        free = engine.step()[-1]
    forced = [(t + 1) % model.config.vocab_size for t in free.token_ids]  # never the greedy choice
    engine.add_request("forced", [1, 2, 3], greedy, forced_output=forced)
    while engine.has_unfinished:
        out = engine.step()[-1]
    assert out.finished and out.token_ids == forced != free.token_ids
    with pytest.raises(RequestError, match="no tokenizer"):
        engine.add_request("text", "hello", greedy)


def test_a_core_steps_only_once_prepared() -> None:
    """Construction allocates; the prepare phase (the executor's kernel plan, in graph mode trace/compile/capture)
    is its own call, and a step before it is refused with a message, not run on an unprepared executor."""
    model = tiny_model(num_layers=2)
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=16))
    engine = EngineCore(config, model, None, EagerExecutor(keep_layout=True))
    assert not engine.runner.is_prepared
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    with pytest.raises(RuntimeError, match=r"EngineCore\.prepare\(\) must run before the first step"):
        engine.step()
    assert engine.prepare() is engine and engine.runner.is_prepared
    outputs = [out for _ in range(2) for out in engine.step()]
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 2
