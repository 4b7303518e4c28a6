"""lm-evaluation-harness end to end: its `local-completions` model scores a small multiple-choice task (written here,
read from a local JSON file, nothing fetched from a hub) against a live `kiln serve` of a tiny float32 Llama. Every
choice's loglikelihood and whether it was greedy (one doc's first choice is the model's greedy next word) equal HF
transformers' on the same weights within 1e-4, and the task's accuracy is the one HF's loglikelihoods give. With
`tokenizer_backend=auto` the harness detects and uses kiln's `/tokenizer_info` and `/tokenize`; with `huggingface`
it tokenizes locally and only sends token ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.tiny_models import write_hf_model
from tests.server.live import LiveServer, live_server

SERVED_NAME = "tiny-llama"
TASK = "kiln_tiny_mc"
DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Fish live in", "choices": ["trees", "water", "fire", "clouds"], "answer": 1},
    {"question": "Ice is made of frozen", "choices": ["sand", "water"], "answer": 1},
    {"question": "A week has seven", "choices": ["days", "years", "metres"], "answer": 0},
]
GREEDY_CONTEXTS = ["Once upon a", "The capital of France is", "My favourite colour is", "In the morning I", "Hello"]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Any]:
    import transformers

    path = tmp_path_factory.mktemp("lm_eval_llama")
    hf = write_hf_model(path, "llama", vocab_size=49152, perturb=0.05)  # the default model's tokenizer
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def docs(model: tuple[Path, torch.nn.Module, Any]) -> list[dict[str, Any]]:
    """DOCS and one doc whose first choice is the model's greedy next word, so one answer is greedy."""
    _, hf, tokenizer = model
    for context in GREEDY_CONTEXTS:
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        with torch.no_grad():
            greedy = int(hf(torch.tensor([context_ids])).logits[0, -1].argmax())
        word = tokenizer.decode([greedy])
        is_word = word.startswith(" ") and word[1:].strip() == word[1:] != ""
        if is_word and encode_pair(tokenizer, context, word) == (context_ids, [greedy]):
            return [*DOCS, {"question": context, "choices": [word[1:], "zebra"], "answer": 0}]
    raise AssertionError(f"no context of {GREEDY_CONTEXTS} has a greedy next token that is a whole word")


@pytest.fixture(scope="module")
def server(model: tuple[Path, torch.nn.Module, Any]) -> Iterator[LiveServer]:
    path, _, _ = model
    args = ["--model-path", str(path), "--served-model-name", SERVED_NAME, "--graph-mode", "eager"]
    args += ["--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64"]
    with live_server(args) as live:
        yield live


def write_task(directory: Path, docs: list[dict[str, Any]]) -> None:
    """The task's YAML and its JSON-lines data, in the directory the harness is told to include."""
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    task = TASK_YAML.format(task=TASK, data=data, cache=directory / "datasets_cache")
    (directory / f"{TASK}.yaml").write_text(task)


def run_lm_eval(directory: Path, model_args: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`lm_eval.simple_evaluate` with the `local-completions` model on this task alone (the task manager indexes
    `directory`, not the harness's thousands of built-in tasks); returns its samples (by doc) and its results."""
    from lm_eval import simple_evaluate  # NOTE: imports `datasets`, which reads the offline variables then
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(directory), include_defaults=False)
    args = dict(model_args=model_args, tasks=[TASK], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    evaluated = simple_evaluate(model="local-completions", **args)
    assert evaluated is not None
    samples = sorted(evaluated["samples"][TASK], key=lambda sample: sample["doc_id"])
    return samples, evaluated["results"][TASK]


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's causal `_encode_pair`: the context's trailing spaces move to the continuation, the
    whole text is encoded (no special tokens) and split at the context's own length."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


def hf_loglikelihood(hf: torch.nn.Module, tokenizer: Any, context: str, continuation: str) -> tuple[float, bool]:
    """HF's sum of the continuation tokens' log-softmax given the context, and whether each was the argmax."""
    context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
    with torch.no_grad():
        logits = hf(torch.tensor([context_ids + continuation_ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(context_ids) - 1 : -1]
    loglikelihood = sum(rows[i, token].item() for i, token in enumerate(continuation_ids))
    return loglikelihood, rows.argmax(-1).tolist() == continuation_ids


def http_counts(server: LiveServer) -> dict[tuple[str, str], float]:
    """kiln_http_requests by (endpoint, status)."""
    counts = {}
    for name, value in server.metrics().items():
        if name.startswith("kiln_http_requests_total{"):
            labels = dict(part.split("=") for part in name[name.index("{") + 1 : -1].split(","))
            counts[(labels["endpoint"].strip('"'), labels["status"].strip('"'))] = value
    return counts


@pytest.mark.parametrize(
    ("tokenizer_args", "remote"),
    [("tokenizer_backend=auto", True), ("tokenizer_backend=huggingface,tokenizer={model}", False)],
    ids=["remote-tokenizer-detected", "hf-tokenizer"],
)
def test_lm_eval_multiple_choice_scores_equal_hf_loglikelihoods(
    server: LiveServer,
    model: tuple[Path, torch.nn.Module, Any],
    docs: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_args: str,
    remote: bool,
) -> None:
    # NOTE: `datasets` reads these when first imported (by the harness, or here); they make any hub access an error
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets.config

    path, hf, tokenizer = model
    write_task(tmp_path, docs)
    before = http_counts(server)
    served = f"base_url={server.url}/v1/completions,model={SERVED_NAME},num_concurrent=1,max_retries=1"
    samples, results = run_lm_eval(tmp_path, f"{served},{tokenizer_args.format(model=path)}")
    calls = {key: value - before.get(key, 0) for key, value in http_counts(server).items()}
    assert {key for key, value in calls.items() if value and key[0] != "/metrics"} <= {
        ("/v1/completions", "200"),
        ("/tokenizer_info", "200"),
        ("/tokenize", "200"),
    }, calls  # nothing refused, nothing else asked for
    # one request a choice (the harness's batch size 1)
    assert calls[("/v1/completions", "200")] == sum(len(doc["choices"]) for doc in docs)
    assert (calls.get(("/tokenizer_info", "200"), 0) > 0) == remote
    assert (calls.get(("/tokenize", "200"), 0) > 0) == remote

    assert datasets.config.HF_HUB_OFFLINE  # nothing could have been fetched
    assert [s["doc"] for s in samples] == docs
    correct = []
    for sample in samples:
        assert [continuation for _, continuation in sample["arguments"]] == [f" {c}" for c in sample["doc"]["choices"]]
        expected = [hf_loglikelihood(hf, tokenizer, *pair) for pair in sample["arguments"]]
        for (loglikelihood, is_greedy), (hf_value, hf_greedy) in zip(sample["filtered_resps"], expected, strict=True):
            assert abs(loglikelihood - hf_value) < 1e-4, (sample["doc_id"], loglikelihood, hf_value)
            assert is_greedy == hf_greedy
        hf_choice = max(range(len(expected)), key=lambda i: expected[i][0])
        correct.append(float(hf_choice == sample["doc"]["answer"]))
        assert sample["acc"] == correct[-1]
    assert results["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert samples[-1]["filtered_resps"][0][1] is True  # the greedy doc's greedy word
