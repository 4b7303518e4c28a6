"""`POST /v1/embeddings` through the app `kiln serve` builds, over a real engine on a tiny float32 Llama (in process,
as tests/server/test_prompt_logprobs_server does): OpenAI's answer for every form of `input`, vectors equal to HF's
final hidden state of the last token, normalized (the default pooling), base64 decoding to the float answer, usage;
the 400s (dimensions, input types, an input longer than the context naming its index, unknown fields, a bad
encoding), the API key and the metrics label; a multi-device engine refuses embeddings."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import httpx
import openai
import pytest
import torch

from kiln import LLM
from kiln.engine.core import EngineCore
from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.errors import RequestError
from tests.engine.tiny_models import write_hf_model
from tests.server.app_harness import openai_error, serve_engine
from tests.server.test_prompt_logprobs_server import multi_device_admission

MAX_MODEL_LEN = 32
TEXTS = ["The kiln fires the clay.", "hi", "A third, somewhat longer sentence about pottery and glazes."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineCore, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny_llama_embed_server")
    hf = write_hf_model(path, "llama", vocab_size=49152, perturb=0.05)
    fp32 = dict(dtype="float32", activations="float32", kv_cache_dtype="float32")
    llm = LLM(str(path), graph_mode="eager", num_kv_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN, **fp32)
    return llm.engine, hf


def embed(core: EngineCore, payload: dict[str, Any]) -> httpx.Response:
    async def body(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/embeddings", json=payload)

    return serve_engine(core, body)


def hf_last(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0)


def test_a_list_of_strings_gets_openais_answer_with_hfs_vectors(tiny) -> None:
    core, hf = tiny

    async def body(client: httpx.AsyncClient) -> tuple[httpx.Response, str]:
        name = (await client.get("/v1/models")).json()["data"][0]["id"]
        return await client.post("/v1/embeddings", json={"model": name, "input": TEXTS, "user": "someone"}), name

    response, name = serve_engine(core, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "list" and answer["model"] == name
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in answer["data"])
    ids = [core.tokenizer.encode(text) for text in TEXTS]
    assert answer["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    for prompt, item in zip(ids, answer["data"], strict=True):
        assert torch.allclose(torch.tensor(item["embedding"]), hf_last(hf, prompt), atol=1e-4, rtol=0)


def test_every_input_form_and_base64_decodes_to_the_floats(tiny) -> None:
    core, hf = tiny
    ids = core.tokenizer.encode(TEXTS[0])
    one_string = embed(core, {"input": TEXTS[0]}).json()
    one_list = embed(core, {"input": ids, "encoding_format": None}).json()  # null asks for nothing: floats
    lists = embed(core, {"input": [ids, [5, 6, 7]]}).json()
    packed = embed(core, {"input": [ids, [5, 6, 7]], "encoding_format": "base64"}).json()
    assert one_string["data"][0]["embedding"] == one_list["data"][0]["embedding"] == lists["data"][0]["embedding"]
    assert one_list["usage"]["prompt_tokens"] == len(ids) and lists["usage"]["prompt_tokens"] == len(ids) + 3
    for plain, coded in zip(lists["data"], packed["data"], strict=True):
        raw = base64.b64decode(coded["embedding"])
        assert len(raw) == 4 * len(plain["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert decoded == pytest.approx(plain["embedding"], abs=1e-7)
    assert torch.allclose(torch.tensor(lists["data"][1]["embedding"]), hf_last(hf, [5, 6, 7]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"input": "hi", "dimensions": 8}, "dimensions", "cannot be truncated"),
        ({"input": [True, False]}, "input", ""),
        ({"input": ["a", 1]}, "input", ""),
        ({"input": {"text": "a"}}, "input", ""),
        ({"input": 3}, "input", ""),
        ({"input": []}, "input", "empty list"),
        ({"input": ["a", ""]}, "input.1", "empty"),
        ({"input": ["short", "word " * (MAX_MODEL_LEN + 4)]}, "input.1", f"max_model_len={MAX_MODEL_LEN}"),
        ({"input": [[1, 2], [3] * (MAX_MODEL_LEN + 1)]}, "input.1", f"max_model_len={MAX_MODEL_LEN}"),
        ({"input": [1, 49152]}, "input", "not in the vocabulary"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format", ""),
        ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens", "not a field kiln serves"),
        ({"input": "hi", "temperature": 0.5}, "temperature", "not a field kiln serves"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(tiny, payload: dict[str, Any], param: str, words: str) -> None:
    core, _ = tiny
    error = openai_error(embed(core, payload), 400)
    assert error["param"] == param, error
    assert words in error["message"]


def test_the_openai_client_embeds_as_floats_and_as_base64(tiny) -> None:
    """The `openai` client asks for base64 unless told otherwise and decodes it itself: both give the same vectors."""
    core, hf = tiny

    sent: list[Any] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/v1/embeddings":
            sent.append(json.loads(request.content).get("encoding_format"))

    async def body(client: httpx.AsyncClient) -> tuple[Any, Any]:
        client.event_hooks["request"].append(record)
        sdk = openai.AsyncOpenAI(api_key="none", base_url="http://localhost/v1", http_client=client, max_retries=0)
        name = (await sdk.models.list()).data[0].id
        packed = await sdk.embeddings.create(model=name, input=TEXTS[:2])
        plain = await sdk.embeddings.create(model=name, input=TEXTS[:2], encoding_format="float")
        return packed, plain

    packed, plain = serve_engine(core, body)
    assert sent == ["base64", "float"]
    for a, b, text in zip(packed.data, plain.data, TEXTS, strict=False):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
        expected = hf_last(hf, core.tokenizer.encode(text))
        assert torch.allclose(torch.tensor(b.embedding), expected, atol=1e-4, rtol=0)
    assert packed.usage.prompt_tokens == plain.usage.total_tokens


def test_an_input_as_long_as_the_context_is_served_and_an_unknown_model_is_a_404(tiny) -> None:
    core, _ = tiny
    response = embed(core, {"input": list(range(3, 3 + MAX_MODEL_LEN))})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    assert openai_error(embed(core, {"input": "hi", "model": "other"}), 404)["param"] == "model"


def test_the_api_key_guards_the_route_and_metrics_count_it(tiny) -> None:
    core, _ = tiny

    async def body(client: httpx.AsyncClient) -> tuple[int, int, str]:
        refused = await client.post("/v1/embeddings", json={"input": "hi"})
        key = {"Authorization": "Bearer k"}
        served_ = await client.post("/v1/embeddings", json={"input": "hi"}, headers=key)
        metrics = await client.get("/metrics", headers=key)
        return refused.status_code, served_.status_code, metrics.text

    refused, ok, metrics = serve_engine(core, body, ["--api-key", "k"])
    assert (refused, ok) == (401, 200)
    assert 'kiln_http_requests_total{endpoint="/v1/embeddings",status="200"} 1.0' in metrics
    assert 'kiln_http_requests_total{endpoint="/v1/embeddings",status="401"} 1.0' in metrics


def test_multi_device_engines_refuse_embeddings_naming_the_field() -> None:
    """Embeddings are pooled on one device: a tensor- or pipeline-parallel engine refuses them (a 400)."""
    admission = multi_device_admission()
    with pytest.raises(RequestError, match="single device") as exc:
        admission.make_request("r", [1, 2, 3], SamplingParams(embed=True))
    assert exc.value.param == "embed"
