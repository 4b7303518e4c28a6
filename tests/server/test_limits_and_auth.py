"""Bounded work and authentication of `kiln serve`, each a regression test for what a hostile client did:
bodies and prompts of any size, 300 prompts x n=64, 200k stop strings, an unbounded queue, a body parsed before
the API key was checked, a key only on the command line, an open /metrics. Over a FakeCore: no model."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import ConfigError
from kiln.launch import main as launch_main
from kiln.server.limits import MAX_QUEUE, MAX_STREAM_BUFFER, PROMPT_CHARS_PER_TOKEN
from tests.server.app_harness import Served, build_served_app, openai_error, serve, wait_until
from tests.server.fake_core import FakeCore

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


class RecordingBody:
    """A streamed request body (no Content-Length unless given) that counts how many chunks were pulled."""

    def __init__(self, num_chunks: int, chunk: bytes = b"x" * 100) -> None:
        self.num_chunks, self.chunk = num_chunks, chunk
        self.num_pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.num_chunks):
            self.num_pulled += 1
            yield self.chunk


# -- bounded work ---------------------------------------------------------------------------------


def test_body_over_max_body_bytes_is_413_before_it_is_parsed() -> None:
    core = FakeCore()

    async def body(s: Served) -> None:
        declared = RecordingBody(50)  # 5000 bytes of invalid JSON, announced by Content-Length
        response = await s.client.post(
            "/v1/completions", content=declared, headers={"Content-Length": "5000", "Content-Type": "application/json"}
        )
        error = openai_error(response, 413)
        assert error["code"] == "body_too_large"
        assert "5000 bytes" in error["message"] and "--max-body-bytes=1000" in error["message"]
        assert declared.num_pulled == 0  # refused from the header alone

        streamed = RecordingBody(100)  # 10000 bytes, chunked: counted while it arrives
        response = await s.client.post("/v1/completions", content=streamed)
        error = openai_error(response, 413)  # not 400 "not valid JSON": it was never parsed
        assert "more than 1000 bytes" in error["message"]
        assert streamed.num_pulled <= 11  # reading stopped just past the limit

        ok = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.request.content) < 1000
        assert core.tokenizer.num_encode_calls == 1  # only the request within the limit was tokenized

    serve(core, body, ["--max-body-bytes", "1000"])


def test_prompt_over_max_prompt_chars_is_refused_before_tokenizing() -> None:
    core = FakeCore(max_model_len=256)

    async def body(s: Served) -> None:
        too_long = await s.client.post("/v1/completions", json={"prompt": "a" * 101, "max_tokens": 1})
        error = openai_error(too_long, 400)
        assert error["param"] == "prompt" and error["code"] == "prompt_too_long"
        assert "101 characters" in error["message"] and "--max-prompt-chars=100" in error["message"]
        second = await s.client.post("/v1/completions", json={"prompt": ["ok", "a" * 101], "max_tokens": 1})
        assert openai_error(second, 400)["param"] == "prompt.1"
        chat = [{"role": "user", "content": "a" * 60}, {"role": "user", "content": "b" * 60}]
        chat_response = await s.client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1})
        assert openai_error(chat_response, 400)["param"] == "messages"  # the messages share one prompt's limit
        assert core.tokenizer.num_encode_calls == 0 and core.tokenizer.num_template_calls == 0

        at_limit = await s.client.post("/v1/completions", json={"prompt": "a" * 100, "max_tokens": 1})
        assert at_limit.status_code == 200 and core.tokenizer.num_encode_calls == 1

    serve(core, body, ["--max-prompt-chars", "100"])


def test_max_prompt_chars_defaults_to_a_multiple_of_max_model_len() -> None:
    app = build_served_app(FakeCore(max_model_len=256))
    assert app.state.serving.limits.max_prompt_chars == PROMPT_CHARS_PER_TOKEN * 256


def test_prompts_times_n_over_max_seqs_per_request_is_400() -> None:
    core = FakeCore(num_blocks=512)

    async def body(s: Served) -> None:
        flood = await s.client.post("/v1/completions", json={"prompt": ["a"] * 300, "n": 64, "max_tokens": 1})
        error = openai_error(flood, 400)
        assert error["param"] == "n" and error["code"] == "too_many_completions"
        assert "19200 completions" in error["message"] and "--max-seqs-per-request=64" in error["message"]
        chat = await s.client.post("/v1/chat/completions", json={"messages": CHAT, "n": 64, "max_tokens": 1})
        assert chat.status_code == 200  # one prompt x 64 is within the default
        assert core.tokenizer.num_encode_calls == 1  # the chat; the flood was refused before tokenizing

        at_limit = await s.client.post("/v1/completions", json={"prompt": ["a"] * 8, "n": 8, "max_tokens": 1})
        assert at_limit.status_code == 200 and len(at_limit.json()["choices"]) == 64

    serve(core, body)


def test_stop_strings_over_their_count_or_length_are_400() -> None:
    core = FakeCore()

    async def body(s: Served) -> None:
        many = await s.client.post("/v1/completions", json={"prompt": "hi", "stop": ["z"] * 17, "max_tokens": 1})
        error = openai_error(many, 400)
        assert error["param"] == "stop" and error["code"] == "too_many_stop_strings"
        assert "17 strings" in error["message"] and "--max-stop-strings=16" in error["message"]
        long = await s.client.post("/v1/chat/completions", json={"messages": CHAT, "stop": ["ok", "z" * 257]})
        error = openai_error(long, 400)
        assert error["param"] == "stop.1" and "--max-stop-chars=256" in error["message"]
        assert core.tokenizer.num_encode_calls == 0

        at_limits = await s.client.post(
            "/v1/completions", json={"prompt": "hi", "stop": ["z" * 256] * 16, "max_tokens": 1}
        )
        assert at_limits.status_code == 200

    serve(core, body)


def test_default_max_queue_is_finite_and_answers_429_with_retry_after() -> None:
    core = FakeCore(max_num_seqs=4, num_blocks=512)
    core.gate.clear()  # hold the engine inside step(): admitted requests stay in flight

    async def body(s: Served) -> None:
        assert s.engine.max_queue == MAX_QUEUE
        capacity = 4 + MAX_QUEUE
        fillers = [
            asyncio.create_task(s.engine.add_requests([(f"fill-{i}", "hi", SamplingParams(max_tokens=1))]))
            for i in range(capacity)
        ]
        await wait_until(lambda: s.engine.num_unfinished == capacity)
        rejected = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        error = openai_error(rejected, 429)
        assert rejected.headers["retry-after"] == "1"
        assert error["code"] == "queue_full" and f"max_queue={MAX_QUEUE}" in error["message"]
        core.gate.set()
        for stream in await asyncio.gather(*fillers):
            stream.close()

    serve(core, body)


def test_requests_beyond_the_queue_are_refused_before_tokenizing() -> None:
    """Room in the queue is held from before tokenizing, so a flood is refused without costing tokenizer time."""
    core = FakeCore(max_num_seqs=1)
    core.tokenizer.gate.clear()  # hold requests in tokenization

    async def body(s: Served) -> None:
        payload = {"prompt": "hi", "max_tokens": 1}
        held = [asyncio.create_task(s.client.post("/v1/completions", json=payload)) for _ in range(3)]
        await wait_until(lambda: core.tokenizer.num_encode_calls == 1)  # one encodes, two wait for the tokenizer
        await asyncio.sleep(0.05)  # let the other two reach the tokenizer thread's queue
        flood_requests = asyncio.gather(*(s.client.post("/v1/completions", json=payload) for _ in range(20)))
        flood = await asyncio.wait_for(flood_requests, timeout=5)  # refused at once, not queued for the tokenizer
        for response in flood:
            error = openai_error(response, 429)
            assert error["code"] == "queue_full" and "max_queue=2" in error["message"]
            assert response.headers["retry-after"] == "1"
        assert s.engine.num_unfinished == 3 and core.tokenizer.num_encode_calls == 1  # the held three, reserved
        core.tokenizer.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200, 200]

    serve(core, body, ["--max-queue", "2"])


def test_requests_being_added_are_counted_once() -> None:
    """200 concurrent requests under a 256 queue: none is a 429, although all of them wait to be added while the
    engine thread is inside a long step (a request was once counted as prepared and as added at that moment)."""
    core = FakeCore(max_num_seqs=4, num_blocks=4096)
    core.gate.clear()  # the engine thread stays inside its step: the requests wait to be added

    async def body(s: Served) -> None:
        running = await s.engine.add_requests([("long", "hi", SamplingParams(max_tokens=2))])  # then it steps
        payload = {"prompt": "hi", "max_tokens": 1}
        posts: list[asyncio.Task] = []

        def settled() -> bool:  # every request is added (waiting for the engine thread) or was answered (a 429)
            return len(s.engine._streams) - 1 + sum(p.done() for p in posts) == len(posts)

        for wave in (130, 70):  # the second wave arrives while the first waits to be added
            posts += [asyncio.create_task(s.client.post("/v1/completions", json=payload)) for _ in range(wave)]
            await wait_until(settled, 30)
        core.gate.set()
        statuses = [r.status_code for r in await asyncio.gather(*posts)]
        assert statuses == [200] * 200, Counter(statuses)
        running.close()

    serve(core, body, ["--max-queue", "256"])


def test_max_stream_buffer_reaches_the_engine() -> None:
    assert build_served_app(FakeCore()).state.engine.max_buffered_outputs == MAX_STREAM_BUFFER
    assert build_served_app(FakeCore(), ["--max-stream-buffer", "8"]).state.engine.max_buffered_outputs == 8


@pytest.mark.alone  # it times the event loop's stalls
def test_a_maximal_prompt_does_not_stall_other_clients() -> None:
    """The real tokenizer holds the GIL for a whole encode; --max-prompt-chars bounds how long that takes."""
    from kiln.model.build import load_tokenizer
    from kiln.model.loader import open_checkpoint

    tokenizer = load_tokenizer(open_checkpoint("default"))  # the default model is part of the install
    encoded_lengths: list[int] = []
    encode = tokenizer.encode

    def recording_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        encoded_lengths.append(len(text))
        return encode(text, add_special_tokens)

    tokenizer.encode = recording_encode  # type: ignore[method-assign]
    core = FakeCore(max_model_len=8192, tokenizer=tokenizer)

    async def body(s: Served) -> None:
        limit = s.app.state.serving.limits.max_prompt_chars
        words = "the quick brown fox jumps over 13 lazy dogs; "
        prompt = (words * (limit // len(words) + 1))[:limit]
        big = asyncio.create_task(s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
        waits = []  # how long each /health poll (and the short pause after it) took: the event loop's stalls
        while not big.done():
            start = time.perf_counter()
            assert (await s.client.get("/health")).status_code == 200
            await asyncio.sleep(0.005)
            waits.append(time.perf_counter() - start)
        assert (await big).status_code == 400  # tokenized, then too long for max_model_len: the work was done
        assert encoded_lengths == [limit]
        assert len(waits) >= 2 and max(waits) < 0.5, f"a /health poll waited up to {max(waits):.2f} s"

    serve(core, body)


# -- authentication -------------------------------------------------------------------------------


def test_api_key_is_checked_before_the_body_is_read(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    core = FakeCore()

    async def body(s: Served) -> None:
        headers = {"Content-Type": "application/json"}
        bad_json = await s.client.post("/v1/completions", content=b'{"prompt": ', headers=headers)
        error = openai_error(bad_json, 401)  # not 400: the body was not parsed
        assert error["code"] == "invalid_api_key" and "no Authorization header" in error["message"]
        assert bad_json.headers["www-authenticate"] == "Bearer"
        unread = RecordingBody(10)
        assert (await s.client.post("/v1/completions", content=unread)).status_code == 401
        assert unread.num_pulled == 0
        wrong = await s.client.post("/v1/models", headers={"Authorization": "Bearer nope"})
        assert "does not match" in openai_error(wrong, 401)["message"]

        with_key = await s.client.post("/v1/completions", content=b'{"prompt": ', headers={**headers, **AUTH})
        assert "not valid JSON" in openai_error(with_key, 400)["message"]
        # every other path is behind the key too (nothing buffered for a stranger); /health and /metrics stay open
        for path in ("/openapi.json", "/nope", "/v1"):
            unread = RecordingBody(10)
            assert (await s.client.post(path, content=unread)).status_code == 401, path
            assert unread.num_pulled == 0 and (await s.client.get(path)).status_code == 401, path
        assert (await s.client.get("/openapi.json", headers=AUTH)).status_code == 200
        assert (await s.client.get("/nope", headers=AUTH)).status_code == 404
        assert (await s.client.get("/health")).status_code == 200
        head = await s.client.head("/health")
        assert head.status_code == 200 and head.content == b""
        assert (await s.client.get("/metrics")).status_code == 200

    serve(core, body, ["--api-key-file", str(key_file)])


@pytest.mark.parametrize(
    ("argv", "environ", "key"),
    [
        ([], {"KILN_API_KEY": KEY}, KEY),
        (["--api-key-file", "{file}"], {}, KEY),
        (["--api-key-file", "{file}"], {"KILN_API_KEY": "from-env"}, KEY),  # the flag wins
        (["--api-key", "from-flag"], {"KILN_API_KEY": "from-env"}, "from-flag"),
    ],
)
def test_api_key_from_environment_file_or_flag(
    tmp_path: Path, argv: list[str], environ: dict[str, str], key: str
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")  # stripped
    argv = [arg.replace("{file}", str(key_file)) for arg in argv]

    async def body(s: Served) -> None:
        assert (await s.client.get("/v1/models")).status_code == 401
        for other in {"from-env", "from-flag"} - {key}:
            assert (await s.client.get("/v1/models", headers={"Authorization": f"Bearer {other}"})).status_code == 401
        models = await s.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"

    serve(FakeCore(), body, argv, environ)


def test_bad_api_key_sources_are_clear_startup_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-key"
    with pytest.raises(ConfigError, match=rf"--api-key-file {missing}: cannot read the API key \(No such file"):
        build_served_app(FakeCore(), ["--api-key-file", str(missing)])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="gives an empty API key"):
        build_served_app(FakeCore(), ["--api-key-file", str(empty)])
    with pytest.raises(ConfigError, match="both --api-key and --api-key-file"):
        build_served_app(FakeCore(), ["--api-key", "k", "--api-key-file", str(empty)])
    with pytest.raises(ConfigError, match="--metrics-auth needs an API key"):
        build_served_app(FakeCore(), ["--metrics-auth"])
    with pytest.raises(ConfigError, match="--allowed-hosts does nothing beside an API key"):
        build_served_app(FakeCore(), ["--api-key", "k", "--allowed-hosts", "box"])
    with pytest.raises(ConfigError, match="--max-seqs-per-request=64 is more than the server ever admits"):
        build_served_app(FakeCore(), ["--max-num-seqs", "8", "--max-queue", "0"])

    # `kiln serve` fails with one line before it loads the model
    assert launch_main(["--model-path", str(tmp_path / "no-model.gguf"), "--api-key-file", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"kiln: error: --api-key-file {missing}: cannot read the API key" in err and "Traceback" not in err
    assert "Loading model" not in err


@pytest.mark.parametrize("metrics_auth", [True, False])
def test_metrics_auth_protects_metrics(metrics_auth: bool) -> None:
    async def body(s: Served) -> None:
        anonymous = await s.client.get("/metrics")
        if metrics_auth:
            openai_error(anonymous, 401)
        else:
            assert anonymous.status_code == 200 and "kiln_engine_steps" in anonymous.text
        with_key = await s.client.get("/metrics", headers=AUTH)
        assert with_key.status_code == 200 and "kiln_engine_steps" in with_key.text
        assert (await s.client.get("/health")).status_code == 200  # /health stays open for probes

    serve(FakeCore(), body, ["--metrics-auth"] if metrics_auth else [], {"KILN_API_KEY": KEY})


def test_every_response_has_its_own_request_id() -> None:
    async def body(s: Served) -> None:
        responses = [await s.client.get("/health"), await s.client.post("/v1/completions", content=b"{")]
        assert [r.status_code for r in responses] == [200, 400]
        ids = [r.headers["x-request-id"] for r in responses]
        assert all(rid.startswith("req-") and len(rid) == 36 for rid in ids) and ids[0] != ids[1]

    serve(FakeCore(), body)


def test_requests_are_still_served_after_refusals() -> None:
    """Refusals leave nothing behind: no engine request, no KV block."""
    core = FakeCore()

    async def body(s: Served) -> None:
        assert (await s.client.post("/v1/completions", json={"prompt": ["a"] * 65})).status_code == 400
        assert (await s.client.post("/v1/completions", content=b"x" * 2000)).status_code == 413
        ok = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xxx"
        await wait_until(lambda: core.pool.num_used_blocks == 0 and s.engine.num_unfinished == 0)

    serve(core, body, ["--max-body-bytes", "1000"])


def test_limits_flags_reject_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_served_app(FakeCore(), ["--max-queue", "-1"])
    assert "--max-queue: expected an integer >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_served_app(FakeCore(), ["--max-body-bytes", "4MB"])
    assert "--max-body-bytes: expected an integer >= 1, got '4MB'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "host", "allowed"),
    [
        ([], "evil.example:8000", False),  # a page that rebound its domain to 127.0.0.1
        ([], "localhost:8000", True),
        ([], "127.0.0.1:8000", True),
        ([], "[::1]:8000", True),
        ([], "10.1.2.3", True),  # an IP address names this machine: no domain to rebind
        (["--allowed-hosts", "kiln.internal,box"], "BOX:8000", True),
        (["--allowed-hosts", "kiln.internal"], "evil.example", False),
        (["--allowed-hosts", "*"], "evil.example", True),
        (["--api-key", KEY], "evil.example", True),  # with a key, the key protects
    ],
)
def test_without_a_key_only_this_servers_host_names_are_answered(argv: list[str], host: str, allowed: bool) -> None:
    body_pulls = RecordingBody(3, b'{"prompt": "hi", "max_tokens": 1}'[:12])

    async def body(s: Served) -> None:
        headers = {"Host": host, **AUTH}
        models = await s.client.get("/v1/models", headers=headers)
        posted = await s.client.post("/v1/completions", content=body_pulls, headers=headers)
        if allowed:
            assert models.status_code == 200
        else:
            error = openai_error(models, 400)
            assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
            assert openai_error(posted, 400)["code"] == "host_not_allowed"
            assert body_pulls.num_pulled == 0  # refused before its body is read

    serve(FakeCore(), body, argv)


def test_a_stalled_upload_gets_408_after_the_body_timeout() -> None:
    """Half a body, then nothing: answered 408 once --body-timeout has passed, the half dropped; a prompt body
    sent whole is served as before."""

    class StalledBody:
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b'{"prompt": "hi", '
            await asyncio.sleep(3600)  # the client never sends the rest
            yield b""

    async def body(s: Served) -> None:
        started = time.monotonic()
        response = await s.client.post("/v1/completions", content=StalledBody(), headers={"Content-Type": "json"})
        error = openai_error(response, 408)
        assert error["code"] == "body_timeout" and "--body-timeout=0.3" in error["message"]
        assert error["type"] == "invalid_request_error"
        assert 0.3 <= time.monotonic() - started < 5
        ok = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200

    serve(FakeCore(), body, ["--body-timeout", "0.3"])


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_body_timeout_rejects_nonsense(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_served_app(FakeCore(), ["--body-timeout", value])
    assert "expected a number of seconds > 0" in capsys.readouterr().err


def test_many_empty_messages_count_their_markup_against_max_prompt_chars() -> None:
    """150k empty messages hold no text, but each costs the template's markup: refused before the template runs.
    The limit is set above their roles' 600k characters, so only the markup's count can refuse them."""
    core = FakeCore()

    async def body(s: Served) -> None:
        messages = [{"role": "user", "content": ""}] * 150_000
        error = openai_error(await s.client.post("/v1/chat/completions", json={"messages": messages}), 400)
        assert error["code"] == "prompt_too_long" and "--max-prompt-chars" in error["message"]
        assert core.tokenizer.num_template_calls == 0
        few = await s.client.post("/v1/chat/completions", json={"messages": messages[:3], "max_tokens": 1})
        assert few.status_code == 200

    serve(core, body, ["--max-body-bytes", str(64 << 20), "--max-prompt-chars", "1000000"])
