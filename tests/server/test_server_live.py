"""A live `python -m kiln.launch` server on the default model, driven by the official openai client.

One server per module (start-up is the slow part); the offline reference `llm` loads while the server loads.
The last test shuts the server down with SIGTERM, so it must stay last.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.bench.commands import run_loadtest_command
from tests.server.live import LiveServer, cli_flags, live_server

API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_TOKENS = 10
PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the tallest mountain on Earth?"}]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    # NOTE: the default graph mode (full_and_piecewise, as `kiln serve` runs) and n-gram speculation on: every
    # greedy answer below is also checked against the offline engine (eager, without speculation)
    args = cli_flags(
        model_path="default",
        api_key=API_KEY,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        max_num_seqs=32,
        shutdown_timeout=60,
        speculative_method="ngram",
    )
    with live_server(args, API_KEY, lambda: request.getfixturevalue("llm")) as live:
        yield live


@pytest.fixture(scope="module")
def reference(server: LiveServer, llm: LLM) -> dict[str, str]:
    """Greedy offline outputs for every prompt used below (one batch, so computed once)."""
    chat_prompt = llm.tokenizer.apply_chat_template(CHAT)
    outs = llm.generate([*PROMPTS, chat_prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {p: o.text for p, o in zip([*PROMPTS, "chat"], outs, strict=True)}


def test_startup_logs_and_models(server: LiveServer) -> None:
    log = "\n".join(server.log)
    assert "[INFO] Loading model default" in log
    assert re.search(r"\[INFO\] KV cache: 256 blocks", log)
    assert f"[INFO] Ready: {server.url} (model SmolLM2-135M-Instruct.Q4_1)" in log
    assert re.search(r"\[INFO\] Graph mode ready in [\d.]+ s \(full_and_piecewise\)", log)
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["kv_cache_total_blocks"] == 256


def test_completions_match_offline(server: LiveServer, reference: dict[str, str]) -> None:
    client = server.client()
    result = client.completions.create(model="default", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in result.choices] == [reference[p] for p in PROMPTS[:2]]
    assert result.usage is not None and result.usage.completion_tokens == 2 * MAX_TOKENS

    stream = client.completions.create(
        model="default",
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[PROMPTS[2]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_matches_offline(server: LiveServer, reference: dict[str, str]) -> None:
    client = server.client()
    reply = client.chat.completions.create(model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == reference["chat"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens <= MAX_TOKENS

    stream = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference["chat"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_seed_stop_and_logprobs(server: LiveServer) -> None:
    client = server.client()
    sampled = client.completions.create(
        model="default", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=123, n=2, logprobs=2
    )
    again = client.completions.create(
        model="default", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=123, n=2, logprobs=2
    )
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded: reproducible
    lp = sampled.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == sampled.choices[0].text

    chat = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)

    stopped = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["7"])
    assert stopped.choices[0].finish_reason == "stop" and "7" not in stopped.choices[0].text


def test_32_concurrent_clients(server: LiveServer, reference: dict[str, str]) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i: int) -> str:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            r = await client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text
        stream = await client.completions.create(
            model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(32)))

    texts = asyncio.run(main())
    assert texts == [reference[PROMPTS[i % len(PROMPTS)]] for i in range(32)]
    server.wait_idle()


def test_disconnecting_clients_free_their_kv_blocks(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long_request = {"model": "default", "prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    before = server.metrics().get('kiln_request_finished_total{finish_reason="abort"}', 0.0)
    for _ in range(3):  # streaming clients that read two events and hang up
        with httpx.stream("POST", f"{server.base_url}/completions", json={**long_request, "stream": True},
                          headers=headers, timeout=60) as response:  # fmt: skip
            events = response.iter_lines()
            next(line for line in events if line.startswith("data: "))
            next(line for line in events if line.startswith("data: "))
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{server.base_url}/completions", json=long_request, headers=headers, timeout=2)
    m = server.wait_idle(timeout=30)  # 480 tokens each would take far longer: the requests were aborted
    assert m['kiln_request_finished_total{finish_reason="abort"}'] - before == 4


def test_errors_have_openai_shape_and_status(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def post(path: str, body: str | dict) -> dict:
        content = body if isinstance(body, str) else json.dumps(body)
        response = httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)
        assert "Traceback" not in response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return {"status": response.status_code, **error}

    bad_json = post("/completions", '{"prompt": "hi", ')
    assert bad_json["status"] == 400 and "not valid JSON" in bad_json["message"]
    bad_field = post("/completions", {"prompt": "hi", "temperature": "hot"})
    assert bad_field["status"] == 400 and bad_field["param"] == "temperature"
    bad_n = post("/chat/completions", {"messages": CHAT, "n": 0})
    assert bad_n["status"] == 400 and bad_n["param"] == "n"
    too_long = post("/completions", {"prompt": "hello " * 100, "max_tokens": 500})
    assert too_long["status"] == 400 and too_long["param"] == "max_tokens"
    assert re.search(r"prompt \(\d+ tokens\) \+ max_tokens \(500\) = \d+ tokens exceeds max_model_len=512",
                     too_long["message"])  # fmt: skip
    image = post("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert image["status"] == 400 and image["param"] == "messages.0.content.0.type"

    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad_temperature:
        client.completions.create(model="default", prompt="hi", temperature=-1)
    assert "temperature" in str(bad_temperature.value)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        server.client(api_key="wrong").completions.create(model="default", prompt="hi")
    assert httpx.get(f"{server.url}/nope").status_code == 401  # every path but /health is behind the key
    assert httpx.get(f"{server.url}/nope", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404
    server.wait_idle()


def test_metrics_parse(server: LiveServer) -> None:
    m = server.metrics()
    for name in ("kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_cache_usage_ratio",
                 "kiln_kv_cache_used_blocks", "kiln_graph_replays_total", "kiln_graph_dynamic_fallbacks_total",
                 "kiln_time_to_first_token_seconds_count", "kiln_time_per_output_token_seconds_count",
                 "kiln_e2e_request_latency_seconds_count", "kiln_spec_decode_num_drafts_total",
                 "kiln_spec_decode_mean_acceptance_length"):  # fmt: skip
        assert name in m, name
    drafts, accepted = m["kiln_spec_decode_num_drafts_total"], m["kiln_spec_decode_num_accepted_tokens_total"]
    assert m["kiln_spec_decode_num_emitted_tokens_total"] == drafts + accepted
    assert accepted <= m["kiln_spec_decode_num_draft_tokens_total"]
    assert drafts == 0 or m["kiln_spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts, abs=1e-3)
    assert m['kiln_http_requests_total{endpoint="/v1/completions",status="200"}'] > 0
    assert m['kiln_http_requests_total{endpoint="/v1/completions",status="400"}'] > 0
    assert m['kiln_http_requests_total{endpoint="/v1/completions",status="401"}'] > 0
    assert m["kiln_time_to_first_token_seconds_count"] > 0


def test_loadtest_against_live_server(server: LiveServer, tmp_path: Path) -> None:
    args = argparse.Namespace(
        url=server.url, model=None, api_key=API_KEY, concurrency=4, num_requests=8, input_len="4:24",
        output_len="2:6", request_rate=20.0, timeout=120.0, seed=0, json=str(tmp_path / "lt.json"),
        plot=str(tmp_path / "lt.png"), shared_prefix_len=0, turns=1,
    )  # fmt: skip
    assert run_loadtest_command(args) == 0
    report = json.loads((tmp_path / "lt.json").read_text())
    assert report["num_completed"] == 8 and report["num_errors"] == 0
    spec = report["speculative_decoding"]  # the server's counts over the test
    assert spec is not None and spec["num_emitted_tokens"] == spec["num_drafts"] + spec["num_accepted_tokens"]
    assert report["e2e_s"]["p99"] >= report["e2e_s"]["p50"] > 0
    assert all(2 <= r["output_tokens"] <= 6 for r in report["requests"])
    assert (tmp_path / "lt.png").stat().st_size > 10_000


def test_loadtest_multi_turn_chats_with_a_shared_system_prompt(server: LiveServer, tmp_path: Path) -> None:
    """Two 3-turn chats with one 48-word system prompt: every request after the first finds the system prompt
    cached, and each turn finds at least the whole blocks of the turn before it (its prompt resent)."""
    args = argparse.Namespace(
        url=server.url, model=None, api_key=API_KEY, concurrency=2, num_requests=6, input_len="4:12",
        output_len="4:8", request_rate=None, timeout=120.0, seed=3, json=str(tmp_path / "lt.json"), plot=None,
        shared_prefix_len=48, turns=3,
    )  # fmt: skip
    assert run_loadtest_command(args) == 0
    report = json.loads((tmp_path / "lt.json").read_text())
    assert report["num_completed"] == 6 and report["num_errors"] == 0
    records = sorted(report["requests"], key=lambda r: (r["conversation"], r["turn"]))
    assert [(r["conversation"], r["turn"]) for r in records] == [(c, t) for c in range(2) for t in range(3)]
    first = min(report["requests"], key=lambda r: r["start"])
    assert all(r["cached_tokens"] >= 48 // 16 * 16 for r in records if r is not first)
    for before, turn in itertools.pairwise(records):
        if turn["turn"] > 0:
            assert turn["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"]
            assert turn["cached_tokens"] >= before["prompt_tokens"] // 16 * 16
    assert report["prefix_cache_hit_rate"] > 0.4


def test_prefix_cache_hits_salts_and_reset(server: LiveServer) -> None:
    """A repeated prompt is found in the prefix cache (counters, /health, the usage's cached_tokens); another
    cache_salt finds nothing of it; POST /reset_prefix_cache needs the API key, drops the evictable blocks and is
    logged."""
    client = server.client()
    prompt = "You are a careful assistant who answers in one word. " * 8 + "Name a colour."

    def hits_after(**extra: object) -> float:
        before = server.metrics()["kiln_prefix_cache_hits_total"]
        response = client.completions.create(
            model="default", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        hits = server.metrics()["kiln_prefix_cache_hits_total"] - before
        assert response.usage.prompt_tokens_details.cached_tokens == hits  # the client is told what was found
        return hits

    hits_after()
    assert hits_after() >= 64  # the whole prompt but its last block, at least 4 blocks of 16
    assert hits_after(cache_salt="tenant-b") == 0  # another tenant's cache holds nothing yet
    assert hits_after(cache_salt="tenant-b") >= 64
    health = httpx.get(f"{server.url}/health").json()
    assert health["prefix_caching"] is True and 0 < health["prefix_cache_hit_rate"] <= 1
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
    server.wait_idle()
    reset = httpx.post(f"{server.url}/reset_prefix_cache", headers=server.headers)
    assert reset.status_code == 200 and reset.json()["dropped_blocks"] >= 8
    assert hits_after() == 0  # dropped: the prompt is computed again
    assert any("Prefix cache cleared" in line for line in server.log)


def test_sigterm_finishes_in_flight_requests_and_exits_0(server: LiveServer) -> None:
    """Must run last: it stops the module's server."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=headers, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(60) == 0
    deadline = time.monotonic() + 10  # the log reader may still be catching up with the exited server
    while "Server stopped" not in (log := "\n".join(server.log)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "SIGTERM: shutting down" in log and "Server stopped" in log
    assert "Traceback" not in log
