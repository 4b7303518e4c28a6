"""LoRA over HTTP (vLLM's interface): `--lora-modules` adapters listed by /v1/models with their `parent`, selected by
a request's `model`; `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` change them at run time only when the
server allows it, a bad adapter a 400 naming its file and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import transformers

from kiln import LLM
from tests.engine.tiny_models import default_tokenizer_json
from tests.lora.adapters import reference, reference_greedy
from tests.server.app_harness import openai_error, serve_engine

PROMPT = [3, 17, 5, 99, 42, 7]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def core(lora_dir: Path, adapters: dict[str, Path]) -> Any:
    base = lora_dir / "base"
    (base / "tokenizer.json").write_text(default_tokenizer_json())
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    llm = LLM(
        str(base),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"all7={adapters['all7-r4']}"],
        num_kv_blocks=32,
        block_size=4,
        graph_mode="eager",
    )
    return llm.engine


async def _text(client: httpx.AsyncClient, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["text"]


def test_adapters_are_models_loaded_and_unloaded_at_run_time(
    core: Any, adapters: dict[str, Path], hf_base: transformers.PreTrainedModel
) -> None:
    want = {
        name: core.tokenizer.decode(
            reference_greedy(reference(hf_base, adapters[key] if key else None), PROMPT, MAX_TOKENS)[0]
        )
        for name, key in (("base", None), ("all7", "all7-r4"), ("kod", "kod-r2"))
    }
    assert len(set(want.values())) == 3  # the three models answer differently, or the test could not tell them apart
    base_name = "base"

    async def body(client: httpx.AsyncClient) -> None:
        models = (await client.get("/v1/models")).json()["data"]
        base_id = models[0]["id"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base_id, None), ("all7", base_id)]
        assert await _text(client, "all7") == want["all7"]
        assert await _text(client, base_id) == want[base_name]
        assert openai_error(await client.post("/v1/completions", json={"model": "kod", "prompt": PROMPT}), 404)
        loaded = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "kod", "lora_path": str(adapters["kod-r2"])}
        )
        assert loaded.status_code == 200, loaded.text
        assert await _text(client, "kod") == want["kod"]
        bad = {"lora_name": "big", "lora_path": str(adapters["qv-r8-rslora"]).replace("qv-r8", "nowhere")}
        error = openai_error(await client.post("/v1/load_lora_adapter", json=bad), 400)
        assert "adapter_config.json: file: missing" in error["message"] and error["param"] == "lora_path"
        again = {"lora_name": "kod", "lora_path": str(adapters["kod-r2"])}
        assert "loaded already" in openai_error(await client.post("/v1/load_lora_adapter", json=again), 400)["message"]
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "kod"})).status_code == 200
        assert openai_error(await client.post("/v1/completions", json={"model": "kod", "prompt": PROMPT}), 404)
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [base_id, "all7"]
        metrics = (await client.get("/metrics")).text
        assert 'kiln_lora_requests_total{adapter="all7"} 1.0' in metrics
        assert f'kiln_lora_generation_tokens_total{{adapter="kod"}} {float(MAX_TOKENS)}' in metrics

    serve_engine(core, body, ["--allow-runtime-lora-updating", "--enable-lora"])


def test_runtime_loading_is_refused_unless_allowed(core: Any, adapters: dict[str, Path]) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        load = {"lora_name": "kod", "lora_path": str(adapters["kod-r2"])}
        error = openai_error(await client.post("/v1/load_lora_adapter", json=load), 403)
        assert "--allow-runtime-lora-updating" in error["message"]
        assert openai_error(await client.post("/v1/unload_lora_adapter", json={"lora_name": "all7"}), 403)

    serve_engine(core, body)
