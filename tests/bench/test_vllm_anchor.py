"""`kiln bench --compare vllm` without vLLM installed: a missing or broken environment is a clear error; the
worker (kiln/bench/vllm_worker.py) runs kiln's closed loop, checked on a fake engine; the runner's round trip
through a child process, with a fake `vllm` package on the child's path; the child's threads bound to kiln's
count."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from kiln.bench.vllm_runner import WORKER, check_vllm, hf_dir_for, run_vllm, worker_env
from kiln.errors import KilnError

FAKE_VLLM = '''
import json, os
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class _Output:
    def __init__(self, request_id, tokens, finished):
        self.request_id, self.finished = request_id, finished
        self.outputs = [type("Completion", (), {"token_ids": tokens})()]

class Engine:
    """One token per running request per step: (sum of the prompt + position) % 1000. Prompts are cached as vLLM's
    prefix cache keeps them: a prompt seen since the last reset is a hit."""
    def __init__(self, max_num_seqs):
        self.running, self.max_num_seqs, self.most = {}, max_num_seqs, 0
        self.cached, self.hits = set(), 0
    def add_request(self, request_id, prompt, params):
        key = tuple(prompt["prompt_token_ids"])
        self.hits += key in self.cached
        self.cached.add(key)
        self.running[request_id] = (prompt["prompt_token_ids"], params.max_tokens, [])
    def step(self):
        self.most = max(self.most, len(self.running))
        assert len(self.running) <= self.max_num_seqs
        outputs = []
        for request_id, (prompt, wanted, tokens) in list(self.running.items()):
            tokens.append((sum(prompt) + len(tokens)) % 1000)
            outputs.append(_Output(request_id, list(tokens), len(tokens) == wanted))
            if len(tokens) == wanted:
                del self.running[request_id]
        return outputs

class LLM:
    def __init__(self, model, **kwargs):
        if os.path.exists(os.path.join(model, "broken")):
            raise RuntimeError("this model cannot load")
        self.model = model
        with open(os.path.join(model, "llm_kwargs.json"), "w") as f:
            json.dump(kwargs | {"threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}, f)
        self.llm_engine = Engine(kwargs["max_num_seqs"])
    def reset_prefix_cache(self):
        with open(os.path.join(self.model, "hits_at_resets.txt"), "a") as f:
            print(self.llm_engine.hits, file=f)
        self.llm_engine.cached.clear()
        return True
'''


def _expected(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 for i in range(n)]


@pytest.fixture
def fake_vllm_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A "Python of vLLM's environment": kiln's own interpreter with a fake vllm package on its path."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("KILN_VLLM_PYTHON", str(python))
    return python


def test_a_missing_or_broken_vllm_environment_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_VLLM_PYTHON", "/nonexistent/bin/python")
    with pytest.raises(KilnError, match=r"/nonexistent/bin/python does not exist: run `make vllm`"):
        check_vllm()
    monkeypatch.setenv("KILN_VLLM_PYTHON", sys.executable)  # kiln's environment: no vllm there
    with pytest.raises(KilnError, match=r"`import vllm` fails in .*No module named 'vllm'.*make vllm"):
        check_vllm()


def test_converting_a_gguf_without_transformers_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` now raises ImportError
    with pytest.raises(KilnError, match=r"dequantizes .*model.gguf for vLLM with HF transformers.*kiln-infer\[hf\]"):
        hf_dir_for(str(gguf))
    assert hf_dir_for(str(tmp_path)) == tmp_path  # an HF directory goes to vLLM as it is, nothing converted


def test_the_worker_runs_kilns_closed_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most `batch size` requests in flight, a new one as soon as one finishes; each request's arrival, first
    token and finish in order, and its tokens whole."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    fake = importlib.import_module("vllm")
    spec = importlib.util.spec_from_file_location("vllm_worker", WORKER)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    prompts = [[i, i + 1] for i in range(7)]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    llm = fake.LLM(str(tmp_path), max_num_seqs=8)
    worker.closed_loop(llm, prompts, 1, 3, "prefill")  # a prefill-only pass over the same prompts first
    wall_s, done = worker.closed_loop(llm, prompts, 5, 3, "t")
    engine = llm.llm_engine
    assert engine.hits == 0  # each pass starts from an empty prefix cache: the timed one finds nothing cached
    assert engine.most == 3 and wall_s > 0
    assert [tokens for *_, tokens in done] == [_expected(p, 5) for p in prompts]
    assert all(arrival <= first <= finished for arrival, first, finished, _ in done)


def test_the_runner_round_trips_through_vllms_python(tmp_path: Path, fake_vllm_python: Path) -> None:
    check_vllm()  # the fake imports
    model = tmp_path / "hf-model"  # an HF directory kiln loaded goes to vLLM as it is
    model.mkdir()
    batches = {1: [[1, 2, 3], [4, 5]], 3: [[6] * 4, [7], [8, 9], [10], [11, 12, 13]]}
    results = run_vllm(str(model), batches, 4, 1)
    assert [(r.system, r.mode, r.batch_size) for r in results] == [
        ("vllm", "cpu bfloat16", 1),
        ("vllm", "cpu bfloat16", 3),
    ]
    for result, prompts in zip(results, batches.values(), strict=True):
        assert result.token_ids == [_expected(p, 4) for p in prompts]
        assert result.num_requests == len(prompts) and result.output_tok_s > 0 and min(result.tpot_s) >= 0
    kwargs = json.loads((model / "llm_kwargs.json").read_text())
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_num_seqs"] == 3 and kwargs["max_model_len"] == 4 + 4 + 16
    assert len(kwargs["threads"].split(",")) == 1  # kiln's thread count: one CPU bound
    # warm-up, then a prefill-only and a timed pass per batch size, each from an empty cache: never a hit
    assert (model / "hits_at_resets.txt").read_text().split() == ["0"] * 5
    (model / "broken").touch()
    with pytest.raises(KilnError, match="the vLLM worker exited with status 1"):
        run_vllm(str(model), batches, 4, 1)


def test_the_child_gets_kilns_cpus_and_not_kilns_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/of/kiln")
    cpus = sorted(os.sched_getaffinity(0))
    env = worker_env(1)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(cpus[0]) and env["OMP_NUM_THREADS"] == "1"
    assert "PYTHONPATH" not in env and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert worker_env(10_000)["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cpus))  # at most the CPUs there are
