"""`kiln serve --tensor-parallel-size 2`: the OpenAI client gets the one-process answer; a killed worker makes the
server answer 503 and exit non-zero within seconds, naming the rank; start-up errors are one clear line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

from kiln import LLM
from kiln.engine.sampling.sampling_params import SamplingParams
from tests.server.live import free_port, live_server

ARGS = ["--quantization", "none", "--graph-mode", "eager", "--seed", "0", "--tensor-parallel-size", "2"]
ARGS += ["--num-kv-blocks", "64"]
PROMPT = "The capital of France is"


def worker_pid(log: list[str]) -> int:
    for line in log:
        if found := re.search(r"\(rank 1\) Rank 1 of 2 \(pid (\d+)\)", line):
            return int(found.group(1))
    raise AssertionError("the worker never logged its rank:\n" + "\n".join(log[-20:]))


def test_serves_the_openai_client_then_fails_fast_when_a_worker_dies(llm: LLM) -> None:
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].text
    with live_server(ARGS) as server:
        reply = server.client().completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.choices[0].text == expected
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200

        os.kill(worker_pid(server.log), signal.SIGKILL)
        killed = time.monotonic()
        statuses = set()
        while server.process.poll() is None and time.monotonic() - killed < 30:
            try:
                r = httpx.post(
                    f"{server.base_url}/completions",
                    json={"model": "default", "prompt": PROMPT, "max_tokens": 4},
                    timeout=10,
                )
                statuses.add(r.status_code)
            except httpx.TransportError:
                pass  # the server is gone
            time.sleep(0.2)
        code = server.process.wait(30)
        assert code != 0 and time.monotonic() - killed < 30
        assert statuses <= {503}  # while it was still up, nothing but 503
        deadline = time.monotonic() + 10  # the log reader may still be catching up with the exited server
        while "Server stopped" not in (log := "\n".join(server.log)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "Worker rank 1 exited with code -9" in log and "engine loop died" in log, log
        assert "Traceback" not in log


def run_generate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kiln.cli", "generate", "--quantization", "none", "--graph-mode", "eager", *args]
    cmd += ["--prompt", "Hi"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_generate("--tensor-parallel-size", "2", "--master-port", str(port))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"kiln: error: --master-port {port} on 127.0.0.1 is in use (Address already in use): pick a free port, or 0"
    ]


def test_a_launcher_world_size_that_disagrees_is_one_line() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    result = run_generate("--tensor-parallel-size", "2", env=env)
    assert result.returncode != 0
    assert (
        "WORLD_SIZE=3 from the launcher, but --tensor-parallel-size 2 x --pipeline-parallel-size 1 needs 2 ranks"
        in (result.stderr)
    )
    assert "Traceback" not in result.stderr


def _two_nodes(port: int) -> tuple[subprocess.CompletedProcess[str], int | None, str]:
    """Node 0's finished `kiln generate`, node 1's exit code and log; node 1 never outlives the call."""
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    cmd = [sys.executable, "-m", "kiln.cli", "generate", "--quantization", "none", "--graph-mode", "eager", *common]
    node1 = subprocess.Popen([*cmd, "--node-rank", "1", "--prompt", "ignored"], stderr=subprocess.PIPE, text=True)
    try:
        node0 = subprocess.run(
            [*cmd, "--node-rank", "0", "--max-tokens", "8", "--temperature", "0", "--prompt", PROMPT],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if "is in use" in node0.stderr:  # node 0 never started: node 1 would wait for it until its timeout
            node1.kill()
        try:
            node1_log = node1.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired as late:  # node 0's output says why node 1 is still waiting
            node1.kill()
            node1_log = f"still running 60 s after node 0 ended; node 0 said:\n{node0.stderr}\nnode 1: {late.stderr}"
        return node0, node1.returncode, node1_log
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()


def test_two_nodes_on_one_machine(llm: LLM) -> None:
    # --nnodes 2: each `kiln generate` runs one rank; node 1 follows node 0's steps and exits 0 when it is done
    for _ in range(3):  # a free port can be taken by another test's connection before node 0 binds it
        node0, node1_code, node1_log = _two_nodes(free_port())
        if "is in use" not in node0.stderr:
            break
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].text
    assert node0.returncode == 0, node0.stderr
    assert node0.stdout.strip() == expected.strip()
    assert node1_code == 0, node1_log
    assert "Rank 1 of 2" in node1_log and "WARNING" not in node1_log
