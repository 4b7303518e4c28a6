"""kiln's native LoRA kernel (`lora_delta`, kiln.kernels.lora) computes the gathered form's products over the same
buffers, reads nothing for tokens without an adapter, refuses bad operands with a message; the kernel plan times it
against the gathered form per layer geometry and binds each layer's winner, which the full decode graph then holds.
Where no native tier loads here, each test asserts the refusal instead."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from kiln import LLM, LoRARequest, SamplingParams
from kiln.kernels import choices
from kiln.kernels import lora as lora_kernels
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.lora import NATIVE, LoRAKernelPlan, NativeForm, NativeLoRA, lora_layers, native_lora
from kiln.kernels.native.build import native_op, runnable_tiers
from kiln.lora import BASE_ONLY, LoRALimits, attach_lora, read_adapter
from kiln.lora.forms import FORMS, GATHERED, STACKED
from kiln.lora.layer import GATHERED_MAX_ROWS
from kiln.model.build import build_model
from kiln.model.loader.hf_loader import HFCheckpoint
from tests.lora.adapters import MAX_POSITIONS, reference, reference_greedy

MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def native_or_refused() -> NativeLoRA | None:
    """The native LoRA ops; where none loads here, asserts that no tier this CPU runs offers them (the caller then
    returns: there is nothing native to check, and the plan's refusal has its own test)."""
    kernels = native_lora()
    if kernels is None:
        assert all(native_op(tier.name, "lora_delta") is None for tier in runnable_tiers())
    return kernels


def _model(lora_dir: Path, adapters: dict[str, Path], dtype: str):
    model = build_model(HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS)
    slots = attach_lora(model, LoRALimits(max_loras=3, max_rank=8, max_num_tokens=16, dtype=dtype))
    slots.load(0, read_adapter(adapters["all7-r4"]))
    slots.load(2, read_adapter(adapters["gate-up-patterns"]))
    return model, slots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_kernel_equals_the_gathered_form(dtype: str, lora_dir: Path, adapters: dict[str, Path]) -> None:
    kernels = native_or_refused()
    if kernels is None:
        return
    model, slots = _model(lora_dir, adapters, dtype)
    native = NativeForm(kernels)
    x = torch.randn(16, 96)
    # runs of one slot of four tokens and more (their shrink and expand four tokens at a time) and shorter ones;
    # fewer than four adapted tokens (of one slot or several) take the one-pass path for a decode step's few
    many = [0, 2, 0, 0, 2, 2, BASE_ONLY, 0, 2, 0, 2, 1, 2, 0, BASE_ONLY, 2]
    for tokens in ([2, BASE_ONLY, 0, 1, 0, 2], [0], [2, BASE_ONLY, 0, 1], [BASE_ONLY, BASE_ONLY], many):
        slots.set_token_slots(tokens)
        for module in MODULES:
            layer = model.get_submodule(f"model.layers.1.{module}")
            inputs = x[: len(tokens), : layer.in_features]
            got, want = native.delta(layer, inputs), FORMS[GATHERED].delta(layer, inputs)
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(1.0, float(want.abs().max())))
            empty = [i for i, t in enumerate(tokens) if t in (BASE_ONLY, 1)]  # slot 1 holds no adapter
            assert not got[empty].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_over_a_packed_base_one_op_computes_the_product_and_the_adapters(
    dtype: str, lora_dir: Path, adapters: dict[str, Path]
) -> None:
    """`kiln::packed_linear_lora` (the base's packed product and the adapters' added in place, one call) equals the
    base's output plus the gathered form's products."""
    kernels = native_or_refused()
    if kernels is None:
        return
    model = build_model(HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS, quantization="int8")
    slots = attach_lora(model, LoRALimits(max_loras=3, max_rank=8, max_num_tokens=16, dtype=dtype))
    slots.load(0, read_adapter(adapters["all7-r4"]))
    slots.load(2, read_adapter(adapters["kod-r2"]))
    slots.set_token_slots([2, BASE_ONLY, 0, 1])
    x = torch.randn(4, 192)
    calls = []
    with torch.inference_mode(), _counting(calls):
        for module in MODULES:
            layer = model.get_submodule(f"model.layers.2.{module}")
            native = layer.few_rows = NativeForm(kernels).bind(layer)
            assert native.fused
            inputs = x[:, : layer.in_features]
            got = native.forward(layer, inputs)
            want = layer.base(inputs) + FORMS[GATHERED].delta(layer, inputs)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(1.0, float(want.abs().max())))
            torch.testing.assert_close(got[[1, 3]], layer.base(inputs)[[1, 3]], rtol=0, atol=0)
    assert len(calls) == len(MODULES)  # one fused op a layer, not a product and a delta
    twin, twin_calls = copy.deepcopy(model), []  # its own codes, bound to nothing: the separate form, the same numbers
    for module in MODULES:
        layer = twin.get_submodule(f"model.layers.2.{module}")
        assert layer.few_rows.fused
        inputs = x[:, : layer.in_features]
        with torch.inference_mode(), _counting(twin_calls):
            got = layer(inputs)
        want = model.get_submodule(f"model.layers.2.{module}")(inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(1.0, float(want.abs().max())))
    assert not twin_calls
    plain = build_model(HFCheckpoint(str(lora_dir / "base")), torch.float32, MAX_POSITIONS)
    attach_lora(plain, LoRALimits(max_loras=3, max_rank=8, max_num_tokens=16))
    layer = plain.get_submodule("model.layers.2.mlp.down_proj")
    assert not NativeForm(kernels).bind(layer).fused  # a float base: the product, then the native delta


@contextmanager
def _counting(calls: list[str]):
    """Count the `kiln::packed_linear_lora` calls made inside."""

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.kiln.packed_linear_lora.default:
                calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        yield


def test_tokens_without_an_adapter_read_nothing(lora_dir: Path) -> None:
    """Buffers of NaN: the gathered form multiplies them by zero (NaN), the native kernel never reads them."""
    kernels = native_or_refused()
    if kernels is None:
        return
    op = kernels.delta
    a, b = torch.full((2 * 4 * 8, 64), float("nan")), torch.full((4 * 8, 48), float("nan"))
    x = torch.randn(3, 64)
    out = op(x, a, b, torch.full((3,), BASE_ONLY), [32, 16], 4, 8)
    assert out.shape == (3, 48) and torch.equal(out, torch.zeros(3, 48))
    assert op(x, a, b, torch.tensor([BASE_ONLY, 1, BASE_ONLY]), [32, 16], 4, 8)[1].isnan().all()


def test_bad_operands_are_refused_with_what_was_expected() -> None:
    kernels = native_or_refused()
    if kernels is None:
        return
    op = kernels.delta
    x, a, b = torch.randn(2, 64), torch.zeros(4 * 8, 64), torch.zeros(4 * 8, 48)
    with pytest.raises(RuntimeError, match=r"token 1 has slot 4; the buffers hold slots 0 to 3"):
        op(x, a, b, torch.tensor([0, 4]), [48], 4, 8)
    with pytest.raises(RuntimeError, match=r"B must be \[32, 40\]"):
        op(x, a, b, torch.tensor([0, 1]), [40], 4, 8)
    with pytest.raises(RuntimeError, match=r"A and B must both be float32 or both bfloat16"):
        op(x, a.bfloat16(), b, torch.tensor([0, 1]), [48], 4, 8)


@pytest.mark.parametrize("winner", [NATIVE, GATHERED])
def test_the_plan_binds_each_geometrys_winner(
    winner: str, lora_dir: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native_or_refused() is None:
        return
    model, _ = _model(lora_dir, adapters, "float32")
    raced = []

    def race(layer):  # the timings faked: the winner is the test's
        raced.append(lora_kernels.geometry(layer))
        return {"times_us": {GATHERED: 2.0 if winner == NATIVE else 1.0, NATIVE: 1.5}, "rows": [1]}

    monkeypatch.setattr(lora_kernels, "_race", race)
    monkeypatch.setattr(choices, "_PROCESS_CHOICES", {})  # this process has made no choice yet
    plan = LoRAKernelPlan.choose(model, KernelChoiceCache(tmp_path))
    assert plan is not None
    shapes = {repr(lora_kernels.geometry(layer)) for layer in lora_layers(model)}
    assert len(shapes) == 4 and sorted(map(repr, raced)) == sorted(shapes)  # each geometry once, of 16 layers
    plan.install(model)
    many = NATIVE if winner == NATIVE else STACKED  # the native kernel serves a prefill chunk too
    for layer in lora_layers(model):
        assert layer.form_for(1).name == layer.form_for(8).name == winner
        assert layer.form_for(GATHERED_MAX_ROWS + 1).name == many
    assert plan.summary().count(winner) == 4


def test_the_plan_refuses_without_a_native_tier(
    lora_dir: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _model(lora_dir, adapters, "float32")
    monkeypatch.setattr(lora_kernels, "native_lora", lambda: None)
    assert LoRAKernelPlan.choose(model, KernelChoiceCache(tmp_path)) is None
    assert all(layer.form_for(1).name == GATHERED for layer in lora_layers(model))


@pytest.mark.parametrize(
    ("winner", "quantization", "op"),
    [
        (NATIVE, "none", "lora_delta"),
        (NATIVE, "int8", "packed_linear_lora"),
        (GATHERED, "none", None),
    ],
)
def test_the_graphs_run_the_bound_form(
    winner: str,
    quantization: str,
    op: str | None,
    base_dir: Path,
    adapters: dict[str, Path],
    hf_base: transformers.PreTrainedModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Either form bound (whatever the timing chose): decode steps replay a graph holding the native op (over a packed
    base, the product and the adapters' in one) or the gathered form's, prefill pieces the native op or the stacked
    form, and the tokens equal HF + PEFT (a float base) or the gathered form in eager mode over the same packed
    weights. Where no native tier loads, the plan binds nothing and the graphs run the torch forms."""
    if native_or_refused() is None:
        op = None
    monkeypatch.setattr(LoRAKernelPlan, "winner", lambda self, layer: winner)
    llm = _llm(base_dir, "full_and_piecewise", quantization, tmp_path)
    full = llm.engine.executor.full
    assert full is not None
    code = "".join(str(c.graph.code) for c in full.checked_code())
    assert all((name == op) == (name in code) for name in ("lora_delta", "packed_linear_lora"))
    prompts, names = [[3, 17, 5, 99, 42, 7], [11, 2]], ["all7-r4", "qv-r8-rslora"]
    requests = [LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    params = SamplingParams(max_tokens=5, temperature=0)
    outs = llm.generate(prompts, params, lora_request=requests)
    if quantization == "none":
        want = [
            reference_greedy(reference(hf_base, adapters[name]), prompt, 5)[0]
            for prompt, name in zip(prompts, names, strict=True)
        ]
    else:
        monkeypatch.setattr(LoRAKernelPlan, "winner", lambda self, layer: GATHERED)
        eager = _llm(base_dir, "eager", quantization, tmp_path)
        want = [out.token_ids for out in eager.generate(prompts, params, lora_request=requests)]
    assert [out.token_ids for out in outs] == want


def _llm(base_dir: Path, graph_mode: str, quantization: str, cache_dir: Path) -> LLM:
    settings = {"compiler": "eager", "capture_sizes": (1, 2, 4)} if graph_mode != "eager" else {}
    return LLM(
        str(base_dir),
        block_size=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=64,
        graph_mode=graph_mode,
        quantization=quantization,
        cache_dir=str(cache_dir),
        **settings,
    )
