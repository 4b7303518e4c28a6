"""An 8,000-token prompt prefilling beside a stream (issue 51): prefill chunks are budgeted by their measured cost
(kiln.engine.scheduling.prefill_budget), so the stream's largest gap between tokens stays under the step target while
the long prompt prefills. Chunks of 512 tokens however deep their context gave the stream gaps of 13 s before issue 51's
grouped prefill attention, and still 0.66 s on machine R (2 Xeon vCPUs), against 0.28 s with a 0.2 s target.

A live eager server over the default model, with `--long-prefill-step-seconds 0.2`; it times
gaps between tokens, so it runs under the `alone` marker."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.live import LiveServer, live_server
from tests.threads import CheckedThread

TARGET_S = 0.2
LONG_TOKENS = 8_000


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # NOTE: eager: the point is the scheduler's chunk budget, which every graph mode shares (no compile to wait for)
    args = ["--model-path", "default", "--graph-mode", "eager", "--max-model-len", "8192", "--seed", "0"]
    args += ["--long-prefill-step-seconds", str(TARGET_S)]
    with live_server(args) as live:
        yield live


def stream_gaps(server: LiveServer, max_tokens: int, started: threading.Event | None = None) -> list[float]:
    """The seconds between consecutive streamed chunks of a short greedy completion (a chunk holds the tokens the
    server had when it was sent: one, or more when the client read late)."""
    body = {
        "prompt": "The history of the river",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    stamps, usage = [], None
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=300) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            if chunk["choices"]:
                stamps.append(time.monotonic())
                if started is not None and len(stamps) == 3:
                    started.set()
    assert usage is not None and usage["completion_tokens"] == max_tokens, usage
    assert len(stamps) >= max_tokens // 2, f"{len(stamps)} chunks for {max_tokens} tokens"
    return [b - a for a, b in itertools.pairwise(stamps[1:])]  # the first gap holds the stream's prefill


def long_prompt() -> list[int]:
    """8,000 token ids of the default model's vocabulary: ordinary ids, no special tokens."""
    return [1000 + (i * 7919) % 40000 for i in range(LONG_TOKENS)]


@pytest.mark.alone
def test_an_8000_token_prompt_leaves_a_streams_gaps_under_the_target(server: LiveServer) -> None:
    alone = stream_gaps(server, 40)
    prompt = long_prompt()
    answers: list[httpx.Response] = []
    started = threading.Event()
    gaps: list[float] = []
    canary = CheckedThread(target=lambda: gaps.extend(stream_gaps(server, 400, started)))
    canary.start()
    assert started.wait(120) or canary.join_checked(1), "the stream did not start"
    sent = time.monotonic()
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    answers.append(httpx.post(f"{server.base_url}/completions", json=body, timeout=600))
    prefill_s = time.monotonic() - sent
    canary.join_checked(600)
    assert answers[0].status_code == 200, answers[0].text[:300]
    assert answers[0].json()["usage"]["prompt_tokens"] == LONG_TOKENS
    assert gaps, "the stream gave no gaps"
    assert prefill_s > 3 * TARGET_S, prefill_s  # the long prompt took several steps: the gaps below are beside it
    bound = max(2.5 * TARGET_S, 5 * max(alone))
    assert max(gaps) < bound, (max(gaps), bound, max(alone), prefill_s)
