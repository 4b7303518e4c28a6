"""AsyncEngine and the HTTP API over a model-free FakeCore: admission (429), recipe violations, failing steps,
aborts that free KV blocks, shutdown. Fast: no model is loaded."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.serving.async_engine import AsyncEngine
from kiln.engine.serving.request_stream import EngineStoppedError, QueueFullError
from kiln.errors import RequestError
from kiln.server.api import AppSettings, create_app
from tests.server.app_harness import openai_error as assert_openai_error
from tests.server.app_harness import wait_until
from tests.server.fake_core import FakeCore
from tests.threads import CheckedThread

Client = httpx.AsyncClient


def run_with_app(
    core: FakeCore, body: Callable[[Client, AsyncEngine], Awaitable[Any]], max_queue: int | None = None
) -> Any:
    """Run `body(client, engine)` against the app in-process (the engine thread started as the lifespan would)."""

    async def main() -> Any:
        engine = AsyncEngine(core, max_queue=max_queue)  # type: ignore[arg-type]
        app = create_app(engine, AppSettings("fake-model"))
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as client:
                return await body(client, engine)
        finally:
            core.gate.set()
            await engine.stop()

    return asyncio.run(main())


def test_generate_streams_outputs_and_finishes() -> None:
    core = FakeCore()

    async def main() -> list[str]:
        engine = AsyncEngine(core)  # type: ignore[arg-type]
        engine.start()
        try:
            return [out.text async for out in engine.generate("r1", "hello", SamplingParams(max_tokens=3))]
        finally:
            await engine.stop()

    assert asyncio.run(main()) == ["x", "xx", "xxx"]
    assert core.pool.num_used_blocks == 0


def test_loop_on_the_callers_thread() -> None:
    """`own_thread=False` (kiln serve): the caller's thread runs the steps; the event loop lives elsewhere."""
    import threading

    core = FakeCore()
    engine = AsyncEngine(core, own_thread=False)  # type: ignore[arg-type]
    steppers: set[int] = set()
    original_step = core.step

    def step() -> Any:
        steppers.add(threading.get_ident())
        return original_step()

    core.step = step  # type: ignore[method-assign]
    texts: list[str] = []

    def http_side() -> None:
        async def main() -> None:
            engine.start()
            assert engine.is_accepting
            texts.extend([out.text async for out in engine.generate("r1", "hello", SamplingParams(max_tokens=3))])
            await engine.stop()

        asyncio.run(main())

    client = CheckedThread(http_side)
    client.start()
    engine.run_loop()  # returns once the client's stop() ends it
    client.join_checked(10)
    assert texts == ["x", "xx", "xxx"]
    assert steppers == {threading.get_ident()}
    assert not engine.is_accepting and core.pool.num_used_blocks == 0


def test_leaving_a_stream_early_aborts_and_frees_blocks() -> None:
    core = FakeCore()

    async def main() -> None:
        engine = AsyncEngine(core)  # type: ignore[arg-type]
        engine.start()
        try:
            async with contextlib.aclosing(engine.generate("r1", "hello", SamplingParams(max_tokens=55))) as gen:
                async for _ in gen:
                    assert core.pool.num_used_blocks > 0
                    break
            await wait_until(lambda: core.pool.num_used_blocks == 0 and engine.num_unfinished == 0)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_bad_request_adds_nothing() -> None:
    core = FakeCore(max_model_len=16)

    async def main() -> None:
        engine = AsyncEngine(core)  # type: ignore[arg-type]
        engine.start()
        try:
            ok = ("a", "hi", SamplingParams(max_tokens=2))
            too_long = ("b", "hi", SamplingParams(max_tokens=100))
            with pytest.raises(RequestError, match="max_model_len=16"):
                await engine.add_requests([ok, too_long])
            await wait_until(lambda: not core.requests)
            assert core.pool.num_used_blocks == 0 and engine.num_unfinished == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_stop_aborts_in_flight_and_refuses_new_requests() -> None:
    core = FakeCore()
    core.step_delay = 0.05  # 60 tokens take 3 s: the request is surely in flight when stop() runs

    async def main() -> None:
        engine = AsyncEngine(core)  # type: ignore[arg-type]
        engine.start()
        stream = await engine.add_requests([("r1", "hi", SamplingParams(max_tokens=60))])
        await stream.__anext__()
        await engine.stop()
        outs = [out async for out in stream]
        assert outs[-1].finish_reason == "abort"
        assert core.pool.num_used_blocks == 0
        with pytest.raises(EngineStoppedError):
            await engine.add_requests([("r2", "hi", SamplingParams())])

    asyncio.run(main())


def test_queue_full_is_429_with_retry_after() -> None:
    core = FakeCore(max_num_seqs=1)
    core.gate.clear()  # hold the engine inside step(): requests stay in flight

    async def body(client: Client, engine: AsyncEngine) -> None:
        payload = {"prompt": "hi", "max_tokens": 2}
        first = [asyncio.create_task(client.post("/v1/completions", json=payload)) for _ in range(2)]
        await wait_until(lambda: engine.num_unfinished == 2)
        rejected = await client.post("/v1/completions", json=payload)
        error = assert_openai_error(rejected, 429)
        assert rejected.headers["retry-after"] == "1"
        assert "max_queue=1" in error["message"] and error["code"] == "queue_full"
        with pytest.raises(QueueFullError):
            await engine.add_requests([("direct", "hi", SamplingParams())])
        core.gate.set()
        assert [r.status_code for r in await asyncio.gather(*first)] == [200, 200]
        await wait_until(lambda: core.pool.num_used_blocks == 0)

    run_with_app(core, body, max_queue=1)


def test_recipe_violation_is_400_naming_the_recipe_line() -> None:
    async def body(client: Client, engine: AsyncEngine) -> None:
        response = await client.post("/v1/completions", json={"prompt": "VIOLATE", "max_tokens": 4})
        error = assert_openai_error(response, 400)
        assert error["message"].startswith("recipe.yaml:9: seq_len <= 32 violated")
        assert error["code"] == "recipe_violation" and error["param"] == "seq_len"

    run_with_app(FakeCore(), body)


def test_failing_step_fails_its_requests_and_the_server_keeps_serving() -> None:
    core = FakeCore()

    async def body(client: Client, engine: AsyncEngine) -> None:
        core.fail_next_step = True
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        error = assert_openai_error(response, 500)
        assert "boom" not in error["message"] and "server log has the details" in error["message"]  # no internals
        assert error["code"] == "engine_error"
        core.fail_next_step = True
        streamed = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True},
        )
        assert streamed.status_code == 200
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "server log has the details" in events[-2] and "boom" not in events[-2] and events[-1] == "data: [DONE]"
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xxxx"
        assert core.pool.num_used_blocks == 0
        metrics = await client.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
        assert families["kiln_engine_step_failures"].samples[0].value == 2
        assert families["kiln_graph_replays"].samples[0].value == 7
        assert families["kiln_graph_dynamic_fallbacks"].samples[0].value == 2

    run_with_app(core, body)


def test_n_choices_and_multiple_prompts_are_indexed_in_order() -> None:
    core = FakeCore()

    async def body(client: Client, engine: AsyncEngine) -> None:
        payload = {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "logprobs": 0}
        data = (await client.post("/v1/completions", json=payload)).json()
        assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
        counts = {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
        assert data["usage"] == counts | {"prompt_tokens_details": {"cached_tokens": 0}}
        assert data["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.5]
        groups = list(core.groups.values())  # the four sequences of one client request share its group
        assert len(groups) == 4 and len(set(groups)) == 1 and groups[0] is not None

    run_with_app(core, body)
