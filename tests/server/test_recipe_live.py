"""A live server under a recipe with the community example's step constraints: a lone request runs (padded to an
allowed shape), one the recipe can never take is a 400 naming the line, and the same holds for `kiln generate`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, live_server

RECIPE = """\
recipe_version: 1
model: {name: smollm2-135m-instruct}
weights: {source_quantization: q4_1}
input_constraints:
  constraints:
    - batch_size % 4 == 0
    - seq_len <= 2048
    - num_tokens <= 16
graph: {mode: full_and_piecewise, capture_sizes: [4, 8, 16]}
memory_plan: {kv_cache: {max_pages: 256}}
hardware: {device: cpu}
"""
LONG = " ".join(["word"] * 20)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "community.yaml"
    path.write_text(RECIPE)
    return path


@pytest.fixture(scope="module")
def server(recipe: Path) -> Iterator[LiveServer]:
    with live_server(["--recipe", str(recipe), "--no-enable-chunked-prefill"]) as live:
        yield live


def complete(server: LiveServer, prompt: str) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_a_lone_request_runs_padded(server: LiveServer) -> None:
    assert server.graph_mode() == "full_and_piecewise"  # as `kiln serve` runs
    response = complete(server, "The capital of France is")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_request_the_recipe_can_never_take_is_a_400_naming_the_line(server: LiveServer, recipe: Path) -> None:
    response = complete(server, LONG)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "recipe_violation" and error["param"] == "prompt"
    assert error["message"].startswith("the prompt (20 tokens) can never be scheduled: no step shape the recipe")
    assert f"{recipe}:8: num_tokens <= 16" in error["message"]
    assert complete(server, "Hello").status_code == 200  # the server goes on


def test_kiln_generate_reports_the_line(recipe: Path) -> None:
    cmd = [sys.executable, "-m", "kiln.cli", "generate", "--recipe", str(recipe), "--no-enable-chunked-prefill"]
    run = subprocess.run([*cmd, "--prompt", LONG, "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert "can never be scheduled" in run.stdout + run.stderr
    assert f"{recipe}:8: num_tokens <= 16" in run.stdout + run.stderr
    assert "Traceback" not in run.stderr
