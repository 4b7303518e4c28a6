"""The fusion contract: which recipe fusion groups the generated code realises, and what happens when it does not.

One compile of the default model (kiln's default mlp_fusion, which the shipped recipe asks for, with logits against
eager); the rest runs on the tiny model, whose pieces compile to the same kernels (tests/compile/tiny.py). The full
decode graph (graph mode full_and_piecewise) is held to the same groups on its layer units' code.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kiln import LLM
from kiln.compile.fusion import FusionReport
from kiln.compile.fusion_check import FusionGroupError, check_fusion
from kiln.compile.kernels import kernels_in
from kiln.compile.settings import graph_config_from
from kiln.config import FusionGroupConfig
from kiln.engine.setup.args import EngineArgs
from kiln.executor.graph import GraphExecutor
from kiln.model.forward_context import ForwardContext, ModelInputs, set_forward_context
from kiln.recipe import load_recipe
from tests.compile.tiny import graph_runner, make_runner, prefill_metadata, tiny_model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"
GROUPS = [
    {"name": "silu_mul", "ops": ["silu", "mul"], "required": False},
    {"name": "tail", "ops": ["silu", "mul", "down_proj"], "required": False},
    {"name": "norm", "ops": ["add", "rms_norm"], "required": False},
    {"name": "rope", "ops": ["q_proj", "k_proj", "rotary_emb"], "required": False},
    {"name": "q_o", "ops": ["q_proj", "o_proj"], "required": False},
    {"name": "o_mlp", "ops": ["o_proj", "gate_proj", "up_proj", "silu", "mul"], "required": False},
]


def recipe_with(tmp_path: Path, groups: str) -> tuple[str, int]:
    """The shipped recipe with `groups` (YAML lines) as its fusion groups; (its path, the first group's line)."""
    text = RECIPE.read_text()
    start = text.index("fusion_groups:\n") + len("fusion_groups:\n")
    end = text.index("\n\n", start) + 1
    path = tmp_path / "recipe.yaml"
    path.write_text(text[:start] + groups + text[end:])
    return str(path), text[:start].count("\n") + 1


def test_default_model_realises_mlp_fusion_and_matches_eager(
    tmp_path: Path, kiln_log: pytest.LogCaptureFixture
) -> None:
    """The shipped recipe's required group (a compile that missed it would fail) plus residual add + norm."""
    args = EngineArgs(
        recipe=str(RECIPE), graph_mode="piecewise", capture_sizes=[1, 4], compile_sizes=[], cache_dir=str(tmp_path)
    )
    config = args.create_engine_config()
    assert [(g.name, g.required) for g in config.graph.fusion_groups] == [("mlp_fusion", True)]
    groups = (*config.graph.fusion_groups, FusionGroupConfig("norm", ("add", "rms_norm"), required=False))
    llm = LLM(config=replace(config, graph=replace(config.graph, fusion_groups=groups)))
    assert "Fusion applied: mlp_fusion" in kiln_log.text and "Fusion applied: norm" in kiln_log.text
    graph = llm.engine.executor
    assert isinstance(graph, GraphExecutor)
    mlp, norm = graph.fusion
    assert mlp.realised and mlp.piece == 1 and mlp.scope == "model.layers.0.mlp"
    gemm, pointwise = mlp.kernels  # gate_up_proj's GEMM, then one kernel for SiLU and the product, reading it
    assert gemm == "extern_kernels.mm" and pointwise.startswith("cpp_fused_mul_silu")
    # the residual add and the post-attention RMSNorm share one kernel too
    assert norm.realised and {"add", "mean", "rsqrt"} <= set(norm.kernels[0].split("_"))
    model, eager = llm.engine.model, make_runner(llm.engine.model)
    for n in (1, 3, 9):
        ids, pos, meta = torch.arange(100, 100 + n), torch.arange(n), prefill_metadata(n)
        with torch.inference_mode(), set_forward_context(ForwardContext(meta, eager.kv_caches)):
            want = model.compute_logits(model(ids, pos))
            pad = graph.pad_to(n) - n
            padded = ModelInputs(
                torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, pos.new_zeros(pad)]), meta, [], []
            )
            got = graph.compute_logits(graph.forward(padded), range(n))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kiln-cache")


@pytest.fixture(scope="module")
def tiny_graph(tiny_cache: Path) -> GraphExecutor:
    """The GROUPS on the tiny model, compiled for dynamic num_tokens and for one static token, with a full decode
    graph (the default graph mode)."""
    _, graph = graph_runner(
        tiny_model(),
        tiny_cache,
        compiler="inductor",
        compile_sizes=(1,),
        fusion_groups=GROUPS,
        mode="full_and_piecewise",
    )
    return graph


@pytest.fixture(scope="module")
def reports(tiny_graph: GraphExecutor) -> dict[str, FusionReport]:
    return {r.name: r for r in tiny_graph.fusion}


@pytest.fixture(scope="module")
def full_reports(tiny_graph: GraphExecutor) -> dict[str, FusionReport]:
    return {r.name: r for r in tiny_graph.full_fusion}


def test_silu_mul_is_applied_where_the_fused_kernel_exists(reports: dict[str, FusionReport]) -> None:
    r = reports["silu_mul"]
    assert r.realised and r.broken_by == "" and r.kernels == ["cpp_fused_mul_silu_split_1"]


def test_add_rms_norm_and_rope_are_realised(reports: dict[str, FusionReport]) -> None:
    assert reports["norm"].realised and reports["norm"].kernels[0].startswith("cpp_fused_add_mean_mul_pow_rsqrt")
    rope = reports["rope"]
    assert rope.realised and rope.piece == 0 and rope.kernels[0] == "extern_kernels.mm"  # the merged qkv_proj
    assert {"cat", "index", "mul", "neg"} <= set(rope.kernels[1].split("_"))


def test_down_proj_after_the_pointwise_ops_is_not_realised(reports: dict[str, FusionReport]) -> None:
    r = reports["tail"]
    assert not r.realised and r.broken_by == "down_proj"
    assert r.reason.startswith("down_proj is an extern BLAS GEMM; nothing fuses into its input")
    # for one static token DecodeGemv makes down_proj a generated reduction, which the SiLU * up kernel joins
    assert r.static == {"1": True}


def test_reports_name_the_op_that_broke_the_group(reports: dict[str, FusionReport]) -> None:
    q_o = reports["q_o"]
    assert (q_o.realised, q_o.broken_by, q_o.piece) == (False, "o_proj", 0)
    assert q_o.reason == "o_proj is in the next piece (1): attention splits the graph between them"
    o_mlp = reports["o_mlp"]
    assert (o_mlp.realised, o_mlp.broken_by) == (False, "o_proj")
    assert o_mlp.reason.startswith(
        "o_proj's output (extern_kernels.mm) reaches cpp_fused_mul_silu_split_1 only through"
    )
    assert "silu" not in o_mlp.reason.split(" reaches ")[0]  # the other four ops are not blamed


def test_the_full_decode_graph_is_checked_on_its_layer_units(full_reports: dict[str, FusionReport]) -> None:
    """The same groups on the full decode graph's code: each judged in one layer unit (a whole decoder layer, attention
    included), so no group is split by attention there."""
    silu_mul, norm, rope = full_reports["silu_mul"], full_reports["norm"], full_reports["rope"]
    assert silu_mul.realised and silu_mul.code == "full decode graph, layer unit 1/2"
    assert silu_mul.kernels == ["cpp_fused_mul_silu_split_3"] and silu_mul.scope == "model.layers.0.mlp"
    # the layer's two RMSNorms: the group means the one the residual add feeds, which shares its kernel
    assert norm.realised and {"add", "mean", "rsqrt"} <= set(norm.kernels[0].split("_"))
    assert rope.realised and rope.kernels[0] == "extern_kernels.mm"
    tail, q_o = full_reports["tail"], full_reports["q_o"]
    assert (tail.realised, tail.broken_by) == (False, "down_proj")
    assert tail.reason.startswith("down_proj is an extern BLAS GEMM; nothing fuses into its input")
    assert (q_o.realised, q_o.broken_by, q_o.reason) == (False, "o_proj", "o_proj is a separate product (o_proj)")


def test_a_required_group_the_full_decode_graph_misses_fails(tiny_graph: GraphExecutor) -> None:
    assert tiny_graph.full is not None
    config = replace(tiny_graph.config, fusion_groups=(FusionGroupConfig("tail", ("silu", "mul", "down_proj")),))
    with pytest.raises(FusionGroupError) as info:
        check_fusion(tiny_graph.full.checked_code(), config, "the full decode graph")
    assert str(info.value).startswith(
        "fusion group tail (required) not realised in the full decode graph: down_proj is an extern BLAS GEMM"
    )


@pytest.mark.parametrize("required", [True, False])
def test_unrealisable_group_from_a_recipe(
    tmp_path: Path, tiny_cache: Path, kiln_log: pytest.LogCaptureFixture, required: bool
) -> None:
    tail = f"  - {{name: mlp_tail, ops: [silu, mul, down_proj], required: {required}}}\n"
    path, line = recipe_with(tmp_path, tail + "  - {name: mlp, ops: [gate_proj, up_proj, silu, mul]}\n")
    config = graph_config_from(load_recipe(path), cache_dir=str(tiny_cache), capture_sizes=(1, 2), compile_sizes=())
    expected = f"{path}:{line}: fusion group mlp_tail ({'required' if required else 'optional'}) not realised: "
    expected += "down_proj is an extern BLAS GEMM; nothing fuses into its input"
    if required:
        with pytest.raises(FusionGroupError) as info:
            make_runner(tiny_model(), GraphExecutor(config))
        assert str(info.value).startswith(expected)
        assert str(info.value).endswith("remove down_proj from the group, or set required: false to compile without it")
        return
    graph = GraphExecutor(config)
    make_runner(tiny_model(), graph)
    warnings = [r.getMessage() for r in kiln_log.records if r.levelno == logging.WARNING]
    assert [w for w in warnings if w.startswith(expected)], warnings
    assert graph.full is not None  # the recipe's graph mode (full_and_piecewise): its full decode graph too
    full = expected.replace("not realised: ", "not realised in the full decode graph: ")
    assert [w for w in warnings if w.startswith(full)], warnings
    assert "Fusion applied: mlp in the full decode graph (extern_kernels.mm -> cpp_fused_mul_silu" in kiln_log.text
    assert "Graph mode ready" in kiln_log.text


def test_eager_compiler_leaves_groups_unchecked(tmp_path: Path, kiln_log: pytest.LogCaptureFixture) -> None:
    groups = [{"name": "mlp_tail", "ops": ["silu", "mul", "down_proj"]}]  # required, but there is no code to check
    _, graph = graph_runner(tiny_model(), tmp_path, compiler="eager", fusion_groups=groups, mode="full_and_piecewise")
    (report,), (full,) = graph.fusion, graph.full_fusion
    assert not report.checked and not report.realised and not full.checked and not full.realised
    assert "Fusion not checked: mlp_tail (piece 1 has no generated code to check (compiler eager" in kiln_log.text
    assert (
        "Fusion not checked: mlp_tail in the full decode graph (full decode graph, layer unit 1/2 has no generated "
        "code to check (compiler eager"
    ) in kiln_log.text


WRAPPER = """
    def call(self, args):
        extern_kernels.mm(buf2, reinterpret_tensor(arg5_1, (64, 256), (1, 64), 0), out=buf3)
        cpp_fused_mul_silu_split_1(buf3, buf4, s72)
        buf9 = buf3; del buf3  # reuse
        buf10 = reinterpret_tensor(buf9, (s72, 4, 8), (64, 16, 1), 8)  # alias
        cpp_fused_add_2(buf10, arg3_1, s72)


cpp_fused_mul_silu_split_1 = async_compile.cpp_pybinding(['const float*', 'float*', 'const int64_t'], r\'\'\'
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
\'\'\')
cpp_fused_add_2 = async_compile.cpp_pybinding(['at::BFloat16*', 'const at::BFloat16*', 'const int64_t'], r\'\'\'
extern "C"  void  kernel(at::BFloat16* in_out_ptr0, const at::BFloat16* in_ptr0, const int64_t ks0)
\'\'\')
"""


TRITON_WRAPPER = """
    def call(self, args):
        with torch.cuda._DeviceGuard(0):
            extern_kernels.mm(buf2, reinterpret_tensor(arg5_1, (64, 256), (1, 64), 0), out=buf3)
            triton_poi_fused_mul_silu_split_1.run(buf3, buf4, s72, 128*s72, stream=stream0)


triton_poi_fused_mul_silu_split_1 = async_compile.triton('triton_poi_fused_mul_silu_split_1', '''
@triton.jit
def triton_poi_fused_mul_silu_split_1(in_ptr0, out_ptr0, ks0, xnumel, XBLOCK : tl.constexpr):
''')
"""


def test_kernels_know_what_they_read_and_write() -> None:
    mm, silu, add = kernels_in(WRAPPER)
    assert (mm.name, mm.is_extern, mm.reads, mm.writes) == ("extern_kernels.mm", True, ("buf2", "arg5_1"), ("buf3",))
    assert (silu.reads, silu.writes, silu.fused_ops) == (("buf3",), ("buf4",), ["mul", "silu", "split"])
    # a reuse and a view of it are the storage they came from; an in-out pointer (of any C++ type) is read and written
    assert (add.reads, add.writes) == (("buf3", "arg3_1"), ("buf3",))
    _, triton = kernels_in(TRITON_WRAPPER)  # the same roles from a Triton kernel's definition
    assert (triton.reads, triton.writes, triton.fused_ops) == (("buf3",), ("buf4",), ["mul", "silu", "split"])
