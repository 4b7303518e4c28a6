"""The issue's fairness measure on a live default-model server: while one client's `n=64` request generates (2,000
tokens each), a new short request gets its first token within ten steps of the running batch (+1 s) and a streaming
canary's tokens are never more than five steps apart (+0.5 s), a step being the canary's median gap. Once, one
such request took every batch slot and the canary waited 120 s; now a client request runs at most half of
--max-num-seqs sequences at once (tests/engine/test_long_prefill.py has the bookkeeping)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.live import LiveServer, cli_flags, live_server
from tests.threads import CheckedThread

pytestmark = pytest.mark.alone  # it times token gaps: beside a compiling worker it would fail

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    args = cli_flags(model_path="default", max_model_len=2048, max_num_seqs=64, max_seqs_per_request=64, seed=0)
    with live_server(args) as live:
        yield live


def token_times(server: LiveServer, body: dict, times: list[float], stop: threading.Event | None = None) -> None:
    """Stream `body`, appending each event's arrival time; close the stream (aborting it) once `stop` is set."""
    with httpx.stream("POST", f"{server.base_url}/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
            if stop is not None and stop.is_set():
                return


def test_an_n_64_request_leaves_room_for_a_short_request_and_a_canary(server: LiveServer) -> None:
    assert server.graph_mode() == "full_and_piecewise"  # as `kiln serve` runs
    big = {"model": MODEL, "prompt": "Write a long story about a dragon.", "n": 64, "max_tokens": 2000,
           "ignore_eos": True, "temperature": 1.0}  # fmt: skip
    big_times: list[float] = []
    stop = threading.Event()
    hog = CheckedThread(token_times, args=(server, big, big_times, stop))
    hog.start()
    deadline = time.monotonic() + 120
    while len(big_times) < 5 * 32 and time.monotonic() < deadline:  # its sequences are decoding
        time.sleep(0.2)
    assert server.metrics()["kiln_num_requests_running"] == 32  # half of --max-num-seqs: the cap per request
    canary: list[float] = []
    # ignore_eos: a sampled canary may end before its 24th token, and its gaps are the measure
    canary_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    canary_thread = CheckedThread(token_times, args=(server, canary_body, canary))
    canary_thread.start()
    deadline = time.monotonic() + 60
    while len(canary) < 3 and time.monotonic() < deadline:  # the canary is decoding beside the hog
        time.sleep(0.05)
    sent = time.monotonic()
    short: list[float] = []
    token_times(server, {"model": MODEL, "prompt": "Hi", "max_tokens": 5}, short)
    canary_thread.join_checked(300)
    stop.set()
    hog.join_checked(300)
    ttft = short[0] - sent
    gaps = [b - a for a, b in itertools.pairwise(canary)]
    # the baseline: one step of this batch, on this load (the canary's median gap); a request left waiting for a
    # batch slot waits out the n=64 request's 2,000 tokens, thousands of steps
    step = sorted(gaps)[len(gaps) // 2]
    # its 24 tokens arrived: a token that completes no text rides the next event (kiln/server/formats.py)
    assert len(canary) >= 20 and ttft < 10 * step + 1.0 and max(gaps) < 5 * step + 0.5, (step, ttft, max(gaps))
    assert server.wait_idle()["kiln_kv_cache_used_blocks"] == 0  # the aborted n=64 request left nothing behind
