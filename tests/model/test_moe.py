"""`kiln::moe` and `FusedMoE`: both implementations against a per-token loop, HF parity through the checkpoint
names `save_pretrained` writes, and one graph node under dynamo whatever the routing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs

from kiln.model import moe
from kiln.model.moe import FusedMoE

HIDDEN, INTER, EXPERTS = 16, 12, 4


def reference_moe(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    activation: str,
) -> torch.Tensor:
    """One token at a time, one expert at a time: the definition the op must meet."""
    inter = w2.shape[2]
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        probs = torch.softmax(logits[t].float(), dim=0)
        chosen = sorted(range(probs.numel()), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e].item() for e in chosen) if renormalize else 1.0
        for e in chosen:
            gate, up = w13[e, :inter] @ hidden[t], w13[e, inter:] @ hidden[t]
            if activation == "silu":
                act = gate * torch.sigmoid(gate)
            else:
                act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
            out[t] += probs[e].item() / total * (w2[e] @ (act * up))
    return out


def random_inputs(num_tokens: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=g)
    logits = torch.randn(num_tokens, EXPERTS, generator=g) * 2
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5
    return tuple(t.to(dtype) for t in (hidden, logits, w13, w2))


def force_impl(monkeypatch: pytest.MonkeyPatch, impl: str) -> list[int]:
    """Make the op run `impl`; the returned list grows by one each time it does."""
    calls: list[int] = []
    real = moe.IMPLS[impl]

    def counted(**kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(**kwargs)

    monkeypatch.setattr(moe, "select_impl", lambda device: impl)
    monkeypatch.setitem(moe.IMPLS, impl, counted)
    return calls


def test_cpu_runs_grouped() -> None:
    assert moe.select_impl(torch.device("cpu")) == "grouped"


@pytest.mark.parametrize("impl", ["grouped", "dense"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_op_matches_reference(
    monkeypatch: pytest.MonkeyPatch, impl: str, top_k: int, renormalize: bool, activation: str
) -> None:
    calls = force_impl(monkeypatch, impl)
    hidden, logits, w13, w2 = random_inputs(9)
    got = torch.ops.kiln.moe(hidden, logits, w13, w2, top_k, renormalize, activation)
    expected = reference_moe(hidden, logits, w13, w2, top_k, renormalize, activation)
    assert calls == [1]
    assert got.shape == hidden.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_op_edge_batches(monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    """No tokens at all, and every token on one expert (the others get empty groups)."""
    force_impl(monkeypatch, impl)
    hidden, logits, w13, w2 = random_inputs(6)
    assert torch.ops.kiln.moe(hidden[:0], logits[:0], w13, w2, 2, True, "silu").shape == (0, HIDDEN)
    skewed = torch.full_like(logits, -5.0)
    skewed[:, 2] = 5.0
    got = torch.ops.kiln.moe(hidden, skewed, w13, w2, 1, False, "silu")
    torch.testing.assert_close(got, reference_moe(hidden, skewed, w13, w2, 1, False, "silu"), atol=1e-5, rtol=0)


def test_bf16_stays_bf16_and_impls_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, logits, w13, w2 = random_inputs(7, torch.bfloat16)
    outs = {}
    for impl in ("grouped", "dense"):
        force_impl(monkeypatch, impl)
        outs[impl] = torch.ops.kiln.moe(hidden, logits, w13, w2, 2, True, "silu")
        assert outs[impl].dtype == torch.bfloat16
    expected = reference_moe(*(t.float() for t in (hidden, logits, w13, w2)), 2, True, "silu")
    torch.testing.assert_close(outs["grouped"].float(), expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs["dense"], outs["grouped"], atol=2e-2, rtol=2e-2)


HF_CASES = {
    "mixtral-silu": ("mixtral", {"hidden_act": "silu"}),
    "mixtral-gelu": ("mixtral", {"hidden_act": "gelu_pytorch_tanh"}),
    "qwen2_moe": ("qwen2_moe", {"norm_topk_prob": False, "shared_expert_intermediate_size": 20}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
}


def hf_model(family: str, overrides: dict[str, object]) -> torch.nn.Module:
    """A one-layer HF model of `family` whose layer-0 MLP is the family's sparse-MoE block, random weights."""
    import transformers

    common = {"vocab_size": 32, "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 2}
    common |= {"num_key_value_heads": 1, "num_experts_per_tok": 2}
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=INTER, num_local_experts=EXPERTS, **overrides)
    else:
        config_class = transformers.Qwen2MoeConfig if family == "qwen2_moe" else transformers.Qwen3MoeConfig
        config = config_class(**common, moe_intermediate_size=INTER, num_experts=EXPERTS, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # Qwen's router starts at zeros: every expert would tie
            param.copy_(torch.randn_like(param) * param.shape[-1] ** -0.5)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HF_CASES))
def test_fused_moe_matches_hf_block(tmp_path: Path, case: str) -> None:
    from safetensors.torch import load_file

    family, overrides = HF_CASES[case]
    model = hf_model(family, overrides)
    model.save_pretrained(tmp_path)
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    config = model.config
    layer = FusedMoE(
        HIDDEN,
        INTER,
        EXPERTS,
        top_k=config.num_experts_per_tok,
        renormalize=getattr(config, "norm_topk_prob", True),
        activation={"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[config.hidden_act],
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0),
    )
    slots = layer.checkpoint_slots("model.layers.0", family)
    block_names = {k for k in saved if k.startswith("model.layers.0.") and ".self_attn." not in k and "norm" not in k}
    assert set(slots) == block_names  # every tensor save_pretrained wrote for the block, and nothing else
    params = dict(layer.named_parameters())
    assert {slot.param for slot in slots.values()} == set(params)
    with torch.no_grad():
        for param in params.values():
            param.fill_(float("nan"))  # a part the slots miss would show
        for name, slot in slots.items():
            assert tuple(saved[name].shape) == slot.shape, name
            slot.view(params[slot.param]).copy_(saved[name])

    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.model.layers[0].mlp(x[None])[0]
        got = layer(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def router_weights(moe_layer: FusedMoE, skewed: bool) -> None:
    """Skewed: every token's first choice is expert 0 (its logit rises with x[:, 0], which tests keep large)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        moe_layer.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
        if skewed:
            moe_layer.gate.weight[:, 0] = torch.tensor([50.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("top_k", [1, 2])
def test_compiled_routing_never_recompiles(top_k: int) -> None:
    torch.manual_seed(0)
    layer = FusedMoE(HIDDEN, INTER, EXPERTS, top_k, renormalize=True).eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for num_tokens, skewed in [(2, True), (5, False), (9, True), (17, False), (3, False)]:
        router_weights(layer, skewed)
        x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
        x[:, 0] = x[:, 0].abs() + 1
        with torch.no_grad():
            first_choice = moe.route(layer.gate(x), top_k, True)[1][:, 0]
            got = compiled(x)
            expected = reference_moe(x, layer.gate(x), layer.w13, layer.w2, top_k, True, "silu")
        assert (first_choice == 0).all() if skewed else first_choice.unique().numel() >= 2
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert counter.frame_count == 1


def test_traced_graph_holds_one_moe_call() -> None:
    layer = FusedMoE(HIDDEN, INTER, EXPERTS, 2, renormalize=False, shared_expert_intermediate_size=8).eval()
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        compiled(torch.randn(4, HIDDEN))
    (graph,) = backend.graphs
    moe_ops = (torch.ops.kiln.moe, torch.ops.kiln.moe.default)  # dynamo records the packet
    assert [n.target for n in graph.graph.nodes if n.target in moe_ops] == [torch.ops.kiln.moe]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_layer() -> FusedMoE:
    torch.manual_seed(0)
    return FusedMoE(HIDDEN, INTER, EXPERTS, 2, renormalize=True, shared_expert_intermediate_size=8).cuda().eval()


def skewed_or_spread_input(num_tokens: int, seed: int) -> torch.Tensor:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = x[:, 0].abs() + 1
    return x.cuda()


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_runs_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under capture the op picks the dense path (no host sync); replays under new routings match eager."""
    picked: list[str] = []
    select = moe.select_impl
    monkeypatch.setattr(moe, "select_impl", lambda device: picked.append(select(device)) or picked[-1])
    layer = cuda_layer()
    static_x = skewed_or_spread_input(8, 0)
    with torch.no_grad():
        layer(static_x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        assert picked == ["grouped", "dense"]
        for seed, skewed in [(1, True), (2, False), (3, True)]:
            router_weights(layer, skewed)
            static_x.copy_(skewed_or_spread_input(8, seed))
            graph.replay()
            torch.testing.assert_close(static_out, layer(static_x), atol=1e-4, rtol=1e-4)
    assert picked[-1] == "grouped"


@pytest.mark.gpu
@needs_cuda
def test_inductor_on_cuda_matches_eager() -> None:
    layer = cuda_layer()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for num_tokens, skewed in [(3, True), (7, False), (16, True)]:
            router_weights(layer, skewed)
            x = skewed_or_spread_input(num_tokens, num_tokens)
            torch.testing.assert_close(compiled(x), layer(x), atol=1e-4, rtol=1e-4)
