"""Cross-section checks: capture sizes, memory budget, KV capacity, splitting ops. Reported, never fixed up."""

from __future__ import annotations

from kiln.recipe import load_recipe

BOUNDS = "input_constraints:\n  constraints:\n    - num_tokens <= 2048\n    - seq_len <= 2048\n"  # lines 4-7


def test_capture_size_must_satisfy_num_tokens(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "graph: {capture_sizes: [1, 8, 4096]}\n"))
    assert (err.line, err.col) == (8, 31)
    assert err.message == "capture size 4096 violates num_tokens <= 2048 (line 6)"


def test_capture_size_against_a_divisibility_constraint(header, write, only_error) -> None:
    path = write(header + BOUNDS + "    - num_tokens % 8 == 0\ngraph: {capture_sizes: [8, 12, 16]}\n")
    err = only_error(path)
    assert (err.line, err.col, err.message) == (9, 28, "capture size 12 violates num_tokens % 8 == 0 (line 8)")


def test_default_capture_sizes_point_at_the_constraint(header, write, diagnostics_of) -> None:
    path = write(header + "input_constraints:\n  constraints: [num_tokens <= 8, seq_len <= 64]\n")
    messages = [(d.line, d.col, d.message) for d in diagnostics_of(path)]
    assert messages[0] == (
        5,
        17,
        "default capture size 16 violates num_tokens <= 8 (line 5) "
        "(graph.capture_sizes is not set: [1, 2, 4, 8, 16, 32])",
    )


def test_duplicate_capture_size(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "graph: {capture_sizes: [1, 8, 8]}\n"))
    assert (err.line, err.col, err.message) == (8, 31, "capture size 8 is listed twice (also on line 8)")


def test_compile_size_must_be_a_capture_size(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "graph: {capture_sizes: [1, 8], compile_sizes: [1, 2]}\n"))
    assert (err.line, err.col) == (8, 51)
    assert err.message == (
        "compile size 2 is not a capture size [1, 8]: a static compile is only run by the capture of its size"
    )


def test_compile_sizes_need_inductor(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "graph: {compiler: eager, compile_sizes: [1]}\n"))
    assert err.line == 8
    assert err.message == "graph.compile_sizes needs compiler inductor; the eager compiler has no static compiles"


def test_compile_sizes_reach_the_graph_config(header, write) -> None:
    from kiln.compile.settings import graph_config_from

    recipe = load_recipe(write(header + BOUNDS + "graph: {capture_sizes: [1, 2, 8], compile_sizes: [2]}\n"))
    assert recipe.compile_sizes == [2]
    assert graph_config_from(recipe).compile_sizes == (2,)
    assert graph_config_from(load_recipe(write(header + BOUNDS))).compile_sizes is None  # automatic


def test_memory_budget(header, write, only_error) -> None:
    path = write(
        header + BOUNDS + "memory_plan: {kv_cache: {dtype: float32, max_pages: 8192}}\n"
        "hardware: {device: cpu, memory_budget_gb: 2.5}\n"
    )
    err = only_error(path)
    assert (err.line, err.col) == (9, 43)
    assert err.message == (
        "memory_budget_gb 2.5 is too small: the KV cache needs 6.04 GB (max_pages 8192 x block_size 16 x 46080 "
        "bytes per token as float32) and the weights 0.54 GB (float32, quantization none): 6.58 GB in all; "
        "lower max_pages or raise the budget"
    )


def test_the_kv_dtype_sets_the_bytes_per_token(header, write, only_error) -> None:
    """int8 codes and their float32 scale per token and head: (64 + 4) bytes a row, 30 layers x 3 KV heads x K and V;
    the default (auto) stores a float32 model's KV as float32, bfloat16 in half its bytes."""
    memory = "hardware: {device: cpu, memory_budget_gb: 1.5}\n"
    err = only_error(write(header + BOUNDS + "memory_plan: {kv_cache: {dtype: int8, max_pages: 8192}}\n" + memory))
    assert err.message.startswith(
        "memory_budget_gb 1.5 is too small: the KV cache needs 1.60 GB (max_pages 8192 x block_size 16 x 12240 "
        "bytes per token as int8)"
    )
    err = only_error(write(header + BOUNDS + "memory_plan: {kv_cache: {max_pages: 8192}}\n" + memory))
    assert "x 46080 bytes per token as float32)" in err.message
    err = only_error(write(header + BOUNDS + "memory_plan: {kv_cache: {dtype: bfloat16, max_pages: 8192}}\n" + memory))
    assert "x 23040 bytes per token as bfloat16)" in err.message


def test_int4_weights_shrink_the_memory_need(header, write) -> None:
    path = write(
        header + BOUNDS + "quantization: {weights: int4}\nmemory_plan: {kv_cache: {max_pages: 1024}}\n"
        "hardware: {device: cpu, memory_budget_gb: 0.95}\n"
    )
    recipe = load_recipe(path)  # float32 weights (0.54 GB) would not fit with the 0.75 GB cache
    assert recipe.diagnostics == [] and recipe.quantization == "packed"  # int4 over a Q4_1 file keeps its blocks


def test_seq_len_beyond_kv_capacity(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "memory_plan: {kv_cache: {block_size: 16, max_pages: 100}}\n"))
    assert (err.line, err.col, err.length) == (7, 7, 15)
    assert err.message == (
        "seq_len can reach 2048 (bounded by seq_len <= 2048 (line 7)) but the KV cache holds "
        "1600 tokens (max_pages 100 x block_size 16, line 8)"
    )


def test_unbounded_seq_len(header, write, only_error) -> None:
    err = only_error(write(header + "input_constraints:\n  constraints: [num_tokens <= 64]\n"))
    assert (err.line, err.col) == (5, 3)
    assert err.message == (
        "seq_len has no provable upper bound, but the KV cache holds 16384 tokens (max_pages 1024 x "
        "block_size 16, the default); add a constraint such as seq_len <= 16384"
    )


def test_seq_len_beyond_model_context_is_a_warning(header, write) -> None:
    recipe = load_recipe(write(header + "input_constraints:\n  constraints: [num_tokens <= 64, seq_len <= 9000]\n"))
    (warning,) = recipe.diagnostics
    assert (warning.severity, warning.line, warning.col) == ("warning", 5, 35)
    assert (
        warning.message
        == "seq_len can reach 9000 but the model was trained for 8192 positions; quality degrades beyond that"
    )


def test_unknown_splitting_op(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "graph: {splitting_ops: [vllm.unified_attention]}\n"))
    assert (err.line, err.col) == (8, 25)
    assert err.message == (
        "unknown splitting op 'vllm.unified_attention' (kiln splits at kiln.attention or kiln::attention)"
    )


def test_piecewise_needs_a_splitting_op(header, write, only_error) -> None:
    err = only_error(write(header + BOUNDS + "graph: {mode: piecewise, splitting_ops: []}\n"))
    assert (err.line, err.col) == (8, 41)
    assert err.message == (
        "graph.mode piecewise splits the forward into pieces but graph.splitting_ops is empty; add kiln.attention"
    )


def test_splitting_ops_are_refused_where_nothing_is_split(header, write, only_error) -> None:
    """graph.mode full runs the whole forward as one graph (and eager no graph): split points would do nothing."""
    for mode in ("full", "eager"):
        err = only_error(write(header + BOUNDS + f"graph: {{mode: {mode}, splitting_ops: ['kiln::attention']}}\n"))
        assert err.line == 8
        assert err.message == f"graph.splitting_ops does nothing under graph.mode {mode} (no piece is split): remove it"
    assert load_recipe(write(header + BOUNDS + "graph: {mode: full}\n")).graph_mode == "full"
