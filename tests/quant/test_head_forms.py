"""An unquantized float32 logits head's second forms (kiln.kernels.head_forms): the bf16 form and the int8 (Q8_0)
copy equal the plain-torch statements of their arithmetic; the kernel plan offers them for the head of a
compressed-tensors W4A16 checkpoint (not where the engine computes in float32 or allows no second forms; the int8
copy's kernels with the engine's own int8 digits); where a form is bound, greedy tokens equal the float32 head's where
the top-2 gap allows, the tied embedding still reads the float32 table, and the start-up log names the form and its
bytes; past the budget the head runs as loaded, and of two forms the one that won one row is made first. Timings
are faked (no test depends on which candidate this machine picks), in a kernel cache of the test's own. Where a
form's kernel does not load here (oneDNN's bf16 brgemm without AVX-512; kiln's native int8 ops without a C++
compiler), each test asserts the refusal instead: the form is never offered and the head runs as loaded."""

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
from kiln.kernels.candidates import NATIVE_INT8X2, native_int8_linear
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.compute_forms import PROBE_TOLERANCE, bf16_form_bytes, brgemm_bf16_op, reference_bf16
from kiln.kernels.head_forms import HeadFormTable, head_candidates
from kiln.kernels.head_kernels import (
    AS_LOADED,
    BRGEMM_BF16_HEAD,
    HEAD_CANDIDATES,
    Q8_GROUP,
    Bf16Head,
    Forms,
    Q8Product,
    q8_copy,
)
from kiln.kernels.native.reference import q8_linear
from tests.model.quantized_models import write_compressed_model

BF16_LOADS = brgemm_bf16_op() is not None  # oneDNN's bf16 brgemm through kiln's avx512 tier
Q8_LOADS = native_int8_linear("int8x2") is not None  # kiln's native int8-activation ops (any ISA tier)
Q8_HEAD = f"q8-{NATIVE_INT8X2}"  # the int8 copy on the lane kernel, two int8 digits of x (the engine's int8x2)
FORM_OF = {Bf16Head: "bf16", Q8Product: "q8"}  # the kind of copy each kernel reads
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


def test_the_int8_head_equals_its_reference_arithmetic() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(72, 64, generator=generator)
    copy = q8_copy(weight)  # codes within half a step of the weight, per group of 32
    step = weight.view(72, -1, Q8_GROUP).abs().amax(-1, keepdim=True) / 127
    assert ((copy.dequantized() - weight).view(72, -1, Q8_GROUP).abs() <= step / 2 + 1e-7).all()
    candidate = HEAD_CANDIDATES[Q8_HEAD]
    assert candidate.runs(weight) == Q8_LOADS
    assert candidate.copy_bytes(weight) == copy.nbytes
    if not Q8_LOADS:  # refused here: never a candidate
        return
    for rows in (1, 2, 7, 32):
        kernel = Forms([weight]).kernel(candidate, rows, column_major=False)
        x = torch.randn(rows, 64, generator=generator)
        got, want = kernel(x, weight), q8_linear(x, copy.codes, copy.scale, copy.offset, digits=2)
        assert got.dtype == torch.float32 and got.shape == (rows, 72)
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, rows


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("w4a16_tied")
    write_compressed_model(directory, "W4A16", tie_word_embeddings=True)  # lm_head ignored: the float32 embedding
    return directory


def _fake_timings(monkeypatch: pytest.MonkeyPatch, winner: str | None) -> None:
    """The packed layers run the reference (their table is not timed); at every row count the head's form `winner`
    (bf16 or q8; None: none) takes half the head as loaded's time and every other form twice it; both
    one-row layouts of the head take the same time; the matrix unit passes its probe."""

    def packed_record(table: packed.PackedKernelTable, layer: object, rows: tuple[int, ...]) -> dict:
        return {"winners": {str(r): "dequant-blas" for r in rows}, "times_us": {}, "ruled_out_us": {}}

    def fake_us(kernel: object, x: torch.Tensor, copies: list, budget_s: float = 0.0) -> float:
        form = FORM_OF.get(type(kernel))
        return (10.0 if form is None else 5.0 if form == winner else 20.0) * x.shape[0]

    monkeypatch.setattr(packed.PackedKernelTable, "_time", packed_record)
    monkeypatch.setattr(packed, "matrix_unit_works", lambda cache: False)
    monkeypatch.setattr(head_forms, "matrix_unit_works", lambda cache: True)
    monkeypatch.setattr(race, "time_us", fake_us)
    monkeypatch.setattr(layout, "time_per_call_us", lambda call, weights: 1.0)


def _llm(directory: Path, cache: Path, **overrides: object) -> LLM:
    options: dict[str, object] = {"activations": "int8x2"} | overrides
    return LLM(str(directory), num_kv_blocks=16, graph_mode="eager", cache_dir=str(cache), **options)


def test_the_plan_offers_the_forms_for_a_w4a16_head(
    w4a16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_timings(monkeypatch, winner=None)
    table = _llm(w4a16, tmp_path).engine.executor.plan.head_forms
    if not (BF16_LOADS or Q8_LOADS):  # nothing to race the head as loaded against
        assert table is None or set(table.candidates) == {AS_LOADED}
        return
    assert table is not None and AS_LOADED in table.candidates
    assert (BRGEMM_BF16_HEAD in table.candidates) == BF16_LOADS and (Q8_HEAD in table.candidates) == Q8_LOADS
    assert all(c.activations != "int8" for c in table.candidates.values())  # the engine's two digits, not one
    for rows in table.rows:  # every form raced where it applies (or ruled out by its time at fewer rows)
        seen = table.record["times_us"][str(rows)] | table.record["ruled_out_us"].get(str(rows), {})
        offered = {name for name, c in table.candidates.items() if c.second_form and c.applies(rows)}
        assert offered and offered <= set(seen), rows
    assert table.kernel(1) is None and table.form is None  # lost everywhere: no copy made
    assert _llm(w4a16, tmp_path, activations="float32").engine.executor.plan.head_forms is None
    assert _llm(w4a16, tmp_path, second_form_memory_gb=0).engine.executor.plan.head_forms is None


@pytest.mark.parametrize("form", ["bf16", "q8"])
def test_greedy_tokens_equal_the_float32_heads_and_the_log_names_the_form(
    form: str, w4a16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kiln_log: pytest.LogCaptureFixture
) -> None:
    _fake_timings(monkeypatch, winner=form)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    reference = _llm(w4a16, tmp_path / "reference", second_form_memory_gb=0).generate([PROMPT], params)[0]
    kiln_log.clear()
    llm = _llm(w4a16, tmp_path / "forms")
    plan, model = llm.engine.executor.plan, llm.engine.model
    if not (BF16_LOADS if form == "bf16" else Q8_LOADS):  # refused: the head runs as loaded
        assert plan.head_forms is None or plan.head_forms.form != form
        return
    assert plan.head_forms is not None and plan.head_forms.kernel(1) is not None and plan.head_t is None
    assert plan.head_forms.form == form
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    got = llm.generate([PROMPT], params)[0].token_ids
    gaps = [abs(a - b) for a, b in (sorted(step.values(), reverse=True)[:2] for step in reference.logprobs)]
    compared = next((i for i, gap in enumerate(gaps) if gap < GAP), len(gaps))
    assert compared >= 4, f"the reference's top-2 gaps {gaps} leave too few tokens to compare"
    assert got[:compared] == reference.token_ids[:compared]
    won_one_row = BRGEMM_BF16_HEAD if form == "bf16" else Q8_HEAD  # (of equal q8 times, the first)
    megabytes = HEAD_CANDIDATES[won_one_row].copy_bytes(model.lm_head.weight) / 2**20
    lines = [r.getMessage() for r in kiln_log.records if r.getMessage().startswith("Logits head: lm_head 256x64")]
    assert len(lines) == 1 and "tied to the embedding" in lines[0], lines
    assert f"1 row {won_one_row}," in lines[0]
    assert f"second form {form} ({megabytes:.1f} MB)" in lines[0]


class _TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(96, 64)
        self.lm_head = nn.Linear(64, 96, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def test_past_the_budget_the_head_runs_as_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_timings(monkeypatch, winner="bf16")
    model, cache = _TiedModel(), KernelChoiceCache(tmp_path)
    candidates = head_candidates(model.lm_head.weight, "int8x2", second_forms=True, cache=cache)
    if not BF16_LOADS:
        assert BRGEMM_BF16_HEAD not in candidates
        return
    table = HeadFormTable(model, cache, (1, 16), candidates)
    assert table.winners() == {1: BRGEMM_BF16_HEAD, 16: BRGEMM_BF16_HEAD}
    assert table.install(budget_bytes=bf16_form_bytes(96, 64) - 1) == 0
    assert table.kernel(1) is None and "over the budget" in table.summary()
    assert table.install(budget_bytes=None) == bf16_form_bytes(96, 64)
    x, weight = torch.randn(10, 64), model.lm_head.weight.detach()  # (10 rows: the class timed at 16)
    torch.testing.assert_close(table.kernel(10)(x), reference_bf16(x, weight), rtol=1e-5, atol=1e-5)
    assert table.kernel(3) is None  # a row class not timed runs the head as loaded


def test_of_two_forms_the_one_that_won_one_row_is_made_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 copy wins one row, the bf16 form 16 rows; a budget for one copy makes the int8 one."""
    _fake_timings(monkeypatch, winner=None)

    def fake_us(kernel: object, x: torch.Tensor, copies: list, budget_s: float = 0.0) -> float:
        fast = {1: Q8Product, 16: Bf16Head}[x.shape[0]]
        return (5.0 if type(kernel) is fast else 10.0) * x.shape[0]

    monkeypatch.setattr(race, "time_us", fake_us)
    model, cache = _TiedModel(), KernelChoiceCache(tmp_path)
    weight = model.lm_head.weight
    candidates = head_candidates(weight, "int8x2", second_forms=True, cache=cache)
    if not (BF16_LOADS and Q8_LOADS):
        assert (BRGEMM_BF16_HEAD in candidates) == BF16_LOADS and (Q8_HEAD in candidates) == Q8_LOADS
        return
    table = HeadFormTable(model, cache, (1, 16), candidates)
    assert table.winners() == {1: Q8_HEAD, 16: BRGEMM_BF16_HEAD}
    q8_bytes, bf16_bytes = HEAD_CANDIDATES[Q8_HEAD].copy_bytes(weight), bf16_form_bytes(96, 64)
    assert table.install(budget_bytes=q8_bytes + bf16_bytes - 1) == q8_bytes
    assert table.form == "q8" and table.kernel(1) is not None and table.kernel(16) is None
    assert "a form over the budget" in table.summary()
    assert table.install(budget_bytes=None) == q8_bytes + bf16_bytes
    x = torch.randn(16, 64)
    torch.testing.assert_close(table.kernel(16)(x), reference_bf16(x, weight.detach()), rtol=1e-5, atol=1e-5)
    assert "second forms q8 (" in table.summary() and "over the budget" not in table.summary()
