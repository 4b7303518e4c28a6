"""An unquantized float32 logits head's second form (kiln.kernels.head_forms): the bf16 form equals the plain-torch
statement of its arithmetic; the kernel plan offers it for the head of a compressed-tensors W4A16 checkpoint (not
where the engine computes in float32 or allows no second forms); where it is bound, greedy tokens equal the float32
head's where the top-2 gap allows, the tied embedding still reads the float32 table, and the start-up log names the
form and its bytes; past the budget the head runs as loaded. Timings are faked (no test depends on which candidate
this machine picks), in a kernel cache of the test's own. Where oneDNN's bf16 brgemm does not load (no AVX-512), each
test asserts the refusal instead: the form is never offered and the head runs as loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import kiln.kernels.head_forms as head_forms
import kiln.kernels.layout as layout
import kiln.kernels.packed as packed
import kiln.kernels.race as race
from kiln import LLM, SamplingParams
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.compute_forms import PROBE_TOLERANCE, bf16_form_bytes, brgemm_bf16_op, reference_bf16
from kiln.kernels.head_forms import (
    AS_LOADED,
    BRGEMM_BF16_HEAD,
    HEAD_CANDIDATES,
    Bf16Head,
    HeadFormTable,
    head_candidates,
)
from tests.model.quantized_models import write_compressed_model

BF16_LOADS = brgemm_bf16_op() is not None  # oneDNN's bf16 brgemm through kiln's avx512 tier
pytestmark = pytest.mark.usefixtures("fresh_kernel_choices")
PROMPT = [5, 17, 42, 7, 99, 3, 61, 250, 11, 8]
GAP = 1e-3  # greedy tokens are compared up to the first step whose reference top-2 logprobs are closer than this


def test_the_bf16_head_equals_its_reference_arithmetic() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(72, 64, generator=generator)  # two blocks of 32 outputs and a tail of 8
    assert HEAD_CANDIDATES[BRGEMM_BF16_HEAD].runs(weight) == BF16_LOADS
    if not BF16_LOADS:  # refused here: never a candidate
        return
    kernel = Bf16Head([weight])
    for rows in (1, 2, 7, 32):
        x = torch.randn(rows, 64, generator=generator)
        got, want = kernel(x, weight), reference_bf16(x, weight)
        assert got.dtype == torch.float32 and got.shape == (rows, 72)
        assert ((got - want).abs().max() / want.abs().max()).item() <= PROBE_TOLERANCE, rows


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("w4a16_tied")
    write_compressed_model(directory, "W4A16", tie_word_embeddings=True)  # lm_head ignored: the float32 embedding
    return directory


def _fake_timings(monkeypatch: pytest.MonkeyPatch, bf16_wins: bool) -> None:
    """The packed layers run the reference (their table is not timed); the head's bf16 form takes half the head
    as loaded's time at every row count when `bf16_wins`, twice it otherwise; both one-row layouts of the head take
    the same time; the matrix unit passes its probe."""

    def packed_record(table: packed.PackedKernelTable, layer: object, rows: tuple[int, ...]) -> dict:
        return {"winners": {str(r): "dequant-blas" for r in rows}, "times_us": {}, "ruled_out_us": {}}

    def fake_us(kernel: object, x: torch.Tensor, copies: list, budget_s: float = 0.0) -> float:
        fast = isinstance(kernel, Bf16Head) == bf16_wins
        return (5.0 if fast else 10.0) * x.shape[0]

    monkeypatch.setattr(packed.PackedKernelTable, "_time", packed_record)
    monkeypatch.setattr(packed, "matrix_unit_works", lambda cache: False)
    monkeypatch.setattr(head_forms, "matrix_unit_works", lambda cache: True)
    monkeypatch.setattr(race, "time_us", fake_us)
    monkeypatch.setattr(layout, "time_per_call_us", lambda call, weights: 1.0)


def _llm(directory: Path, cache: Path, **overrides: object) -> LLM:
    options: dict[str, object] = {"activations": "int8x2"} | overrides
    return LLM(str(directory), num_kv_blocks=16, graph_mode="eager", cache_dir=str(cache), **options)


def test_the_plan_offers_the_bf16_form_for_a_w4a16_head(
    w4a16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_timings(monkeypatch, bf16_wins=False)
    table = _llm(w4a16, tmp_path).engine.executor.plan.head_forms
    if not BF16_LOADS:  # nothing to race the head as loaded against
        assert table is None or set(table.candidates) == {AS_LOADED}
        return
    assert table is not None and set(table.candidates) == {AS_LOADED, BRGEMM_BF16_HEAD}
    for rows in table.rows:  # raced at every row count timed (or ruled out by its time at fewer rows)
        seen = table.record["times_us"][str(rows)] | table.record["ruled_out_us"].get(str(rows), {})
        assert BRGEMM_BF16_HEAD in seen, rows
    assert table.kernel(1) is None and table.form is None  # lost everywhere: no copy made
    assert _llm(w4a16, tmp_path, activations="float32").engine.executor.plan.head_forms is None
    assert _llm(w4a16, tmp_path, second_form_memory_gb=0).engine.executor.plan.head_forms is None


def test_greedy_tokens_equal_the_float32_heads_and_the_log_names_the_form(
    w4a16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kiln_log: pytest.LogCaptureFixture
) -> None:
    _fake_timings(monkeypatch, bf16_wins=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    reference = _llm(w4a16, tmp_path / "reference", second_form_memory_gb=0).generate([PROMPT], params)[0]
    kiln_log.clear()
    llm = _llm(w4a16, tmp_path / "forms")
    plan, model = llm.engine.executor.plan, llm.engine.model
    if not BF16_LOADS:  # the head runs as loaded: the reference's own arithmetic, token for token
        assert plan.head_forms is None or plan.head_forms.kernel(1) is None
        assert llm.generate([PROMPT], params)[0].token_ids == reference.token_ids
        return
    assert plan.head_forms is not None and plan.head_forms.kernel(1) is not None and plan.head_t is None
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    got = llm.generate([PROMPT], params)[0].token_ids
    gaps = [abs(a - b) for a, b in (sorted(step.values(), reverse=True)[:2] for step in reference.logprobs)]
    compared = next((i for i, gap in enumerate(gaps) if gap < GAP), len(gaps))
    assert compared >= 4, f"the reference's top-2 gaps {gaps} leave too few tokens to compare"
    assert got[:compared] == reference.token_ids[:compared]
    megabytes = bf16_form_bytes(256, 64) / 2**20
    lines = [r.getMessage() for r in kiln_log.records if r.getMessage().startswith("Logits head: lm_head 256x64")]
    assert len(lines) == 1 and "tied to the embedding" in lines[0], lines
    assert f"1 row {BRGEMM_BF16_HEAD}" in lines[0]
    assert f"second form {BRGEMM_BF16_HEAD} ({megabytes:.1f} MB)" in lines[0]


class _TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(96, 64)
        self.lm_head = nn.Linear(64, 96, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def test_past_the_budget_the_head_runs_as_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_timings(monkeypatch, bf16_wins=True)
    model, cache = _TiedModel(), KernelChoiceCache(tmp_path)
    candidates = head_candidates(model.lm_head.weight, "int8x2", second_forms=True, cache=cache)
    if not BF16_LOADS:
        assert set(candidates) == {AS_LOADED}
        return
    table = HeadFormTable(model, cache, (1, 16), candidates)
    assert table.winners() == {1: BRGEMM_BF16_HEAD, 16: BRGEMM_BF16_HEAD}
    assert table.install(budget_bytes=bf16_form_bytes(96, 64) - 1) == 0
    assert table.kernel(1) is None and "over the budget" in table.summary()
    assert table.install(budget_bytes=None) == bf16_form_bytes(96, 64)
    x, weight = torch.randn(10, 64), model.lm_head.weight.detach()  # (10 rows: the class timed at 16)
    torch.testing.assert_close(table.kernel(10)(x), reference_bf16(x, weight), rtol=1e-5, atol=1e-5)
    assert table.kernel(3) is None  # a row class not timed runs the head as loaded
