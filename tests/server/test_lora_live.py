"""A live `kiln serve --enable-lora --allow-runtime-lora-updating` on a tiny model built here (HF + PEFT, nothing
downloaded): a stream runs to its last token while another client loads an adapter; the `openai` client selects the
adapter by `model` and gets HF + PEFT's greedy answer (not the base's); unload drops it from /v1/models and reload
serves it again; the graph counters on /metrics show no trace, compile or capture after start-up."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import transformers

from kiln.model.build import load_tokenizer
from kiln.model.loader import open_checkpoint
from tests.engine.tiny_models import default_tokenizer_json
from tests.lora.adapters import SEVEN, reference, reference_greedy, write_adapter, write_base
from tests.server.live import LiveServer, cli_flags, live_server

PROMPT = [3, 17, 5, 99, 42, 7]
MAX_TOKENS = 6
STREAM_TOKENS = 160
# the graph executor's counters of work done once at start-up (kiln_graph_<name> on /metrics)
START_UP_WORK = ("graphs_traced", "pieces_compiled", "static_compiles", "pieces_captured", "full_graphs_captured")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, transformers.PreTrainedModel]:
    """(the base directory with a tokenizer, a strong rank-4 adapter on all seven targets, the HF base)."""
    root = tmp_path_factory.mktemp("lora_live")
    hf_base = write_base(root / "base", num_layers=2)
    (root / "base" / "tokenizer.json").write_text(default_tokenizer_json())
    (root / "base" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    adapter = write_adapter(hf_base, root / "all7", SEVEN, rank=4, seed=0)
    return root / "base", adapter, hf_base


@pytest.fixture(scope="module")
def server(tiny: tuple[Path, Path, transformers.PreTrainedModel]) -> Iterator[LiveServer]:
    base, _, _ = tiny
    # NOTE: graph mode (the pieces and the full decode graph, captured), uncompiled so the start is quick
    flags = cli_flags(model=str(base), max_lora_rank=8, max_loras=2, num_kv_blocks=64, block_size=4, compiler="eager")
    args = [*flags, "--capture-sizes", "1,2,4", "--enable-lora", "--allow-runtime-lora-updating"]
    with live_server(args, command=("-m", "kiln.cli", "serve")) as live:
        yield live


def _model_ids(server: LiveServer) -> list[str]:
    return [m.id for m in server.client().models.list().data]


def _answer(server: LiveServer, model: str) -> str:
    out = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_adapters_load_serve_unload_and_reload_while_a_stream_runs(
    server: LiveServer, tiny: tuple[Path, Path, transformers.PreTrainedModel]
) -> None:
    base_dir, adapter, hf_base = tiny
    tokenizer = load_tokenizer(open_checkpoint(str(base_dir)))
    want = {
        name: tokenizer.decode(reference_greedy(reference(hf_base, path), PROMPT, MAX_TOKENS)[0])
        for name, path in (("base", None), ("all7", adapter))
    }
    assert want["base"] != want["all7"]  # a strong adapter, or the test could not tell them apart
    (base_id,) = _model_ids(server)
    started = server.metrics()
    assert started["kiln_graph_pieces_captured"] > 0  # graph mode runs: there is something to not redo

    streamed: list[str] = []
    usage: list[int] = []
    first_token = threading.Event()

    def stream() -> None:
        chunks = server.client().completions.create(
            model=base_id,
            prompt=PROMPT,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            first_token.set()
            streamed.extend(choice.text for choice in chunk.choices)
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first_token.wait(60)  # the stream is under way: the adapter loads beside it
    load = {"lora_name": "all7", "lora_path": str(adapter)}
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200, loaded.text
    streaming.join(120)
    assert not streaming.is_alive() and usage == [STREAM_TOKENS]  # every token of the stream arrived
    assert "".join(streamed).startswith(want["base"])

    assert [(m.id, getattr(m, "parent", None)) for m in server.client().models.list().data] == [
        (base_id, None),
        ("all7", base_id),
    ]
    assert _answer(server, "all7") == want["all7"]
    assert _answer(server, base_id) == want["base"]
    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "all7"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert _model_ids(server) == [base_id]
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    assert _model_ids(server) == [base_id, "all7"]
    assert _answer(server, "all7") == want["all7"]

    after = server.wait_idle()
    redone = {n: after[f"kiln_graph_{n}"] - started[f"kiln_graph_{n}"] for n in START_UP_WORK}
    assert redone == dict.fromkeys(START_UP_WORK, 0)
    assert after['kiln_lora_requests_total{adapter="all7"}'] == 2
