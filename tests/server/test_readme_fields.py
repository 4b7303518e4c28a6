"""README request fields that had no test: `max_completion_tokens` (chat; wins over `max_tokens`) and `best_of`
(= `n`: all n choices come back; any other value is a 400 naming it). Over a FakeCore, through `kiln serve`'s app."""

from __future__ import annotations

from tests.server.app_harness import Served, openai_error, serve
from tests.server.fake_core import FakeCore

CHAT = [{"role": "user", "content": "hi"}]


def test_max_completion_tokens_bounds_a_chat_completion_and_wins_over_max_tokens() -> None:
    async def body(s: Served) -> None:
        for fields, tokens in (({"max_completion_tokens": 3}, 3), ({"max_completion_tokens": 2, "max_tokens": 5}, 2)):
            response = await s.client.post("/v1/chat/completions", json={"messages": CHAT, **fields})
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["usage"]["completion_tokens"] == tokens, (fields, answer)
            assert answer["choices"][0]["finish_reason"] == "length"

    serve(FakeCore(), body)


def test_best_of_equal_to_n_returns_every_choice_and_any_other_is_refused_by_name() -> None:
    async def body(s: Served) -> None:
        request = {"prompt": "hi", "max_tokens": 2, "n": 3, "best_of": 3}
        response = await s.client.post("/v1/completions", json=request)
        assert response.status_code == 200, response.text
        assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1, 2]
        refused = await s.client.post("/v1/completions", json={**request, "best_of": 4})
        error = openai_error(refused, 400)
        assert error["param"] == "best_of" and "n=3" in error["message"]

    serve(FakeCore(), body)
