"""`make serve`'s exact command, `kiln serve --model default` (a free port added), in its default graph mode
(full_and_piecewise: captured full graphs for decode steps, pieces for mixed ones), answers a chat over HTTP, streamed
and not, with the tokens of the same request sent again (its prompt then a prefix-cache hit)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, live_server

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"
CHAT = {"messages": [{"role": "user", "content": "Write a haiku about a kiln."}], "max_tokens": 24, "temperature": 0}


def make_serve_args() -> list[str]:
    """The arguments of `kiln` in the Makefile's serve recipe (`$(BIN)/kiln serve --model default`)."""
    recipe = re.search(r"^serve:.*\n\t(.+)$", MAKEFILE.read_text(), re.M)
    assert recipe is not None, "the Makefile has a serve target with a one-line recipe"
    program, *args = shlex.split(recipe.group(1))
    assert program == "$(BIN)/kiln", recipe.group(1)
    return args


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    subcommand, *args = make_serve_args()
    assert subcommand == "serve"
    with live_server(args, command=("-m", "kiln.cli", "serve")) as live:
        yield live


def test_make_serve_answers_a_chat_in_the_default_graph_mode(server: LiveServer) -> None:
    ready = [line for line in server.log if "Graph mode ready" in line]
    assert ready and "(full_and_piecewise)" in ready[0], server.log[-20:]
    url = f"{server.base_url}/chat/completions"
    first = httpx.post(url, json=CHAT, timeout=300)
    assert first.status_code == 200, first.text
    answer = first.json()
    text = answer["choices"][0]["message"]["content"]
    assert text.strip() and answer["usage"]["completion_tokens"] > 0
    hits_before = server.metrics()["kiln_prefix_cache_hits_total"]
    with httpx.stream("POST", url, json={**CHAT, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == text  # greedy: the same tokens, decoded by captured full graphs both times
    assert server.metrics()["kiln_prefix_cache_hits_total"] > hits_before  # the prompt's blocks were found
    assert server.wait_idle()["kiln_kv_cache_used_blocks"] == 0
