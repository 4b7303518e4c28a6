"""Cross-section checks that need no solver: graph splitting ops, fusion groups, input tensors, quantization
group size and the memory budget. Each finding is reported; nothing is ever fixed up silently."""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.graph_mode import GraphMode
from kiln.model.dtypes import parse_dtype
from kiln.model.kv_format import STORAGE, is_scaled, kv_dtype_name, kv_storage_dtype
from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.expr import MODEL_SYMBOLS, SYMBOLS
from kiln.recipe.schema import SPLITTING_OPS, RecipeSpec
from kiln.recipe.schema_check import did_you_mean
from kiln.recipe.source import SourceDoc

FUNCTIONAL_OPS = ("silu", "mul", "add", "rms_norm", "rotary_emb")
# Which side of its layer's attention each op of a llama-style decoder layer runs on. Attention (kiln.attention)
# splits the graph and is an opaque op even in one full graph, and groups are matched within one layer, so a group
# cannot hold ops from both sides. The embedding runs before the first attention, the final norm after the last;
# mul, add and rms_norm run on both sides.
BEFORE_ATTENTION = ("embed_tokens", "input_layernorm", "q_proj", "k_proj", "v_proj", "qkv_proj", "rotary_emb")
MLP_OPS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj", "silu")
AFTER_ATTENTION = ("o_proj", "post_attention_layernorm", *MLP_OPS, "norm")
# input name -> (expected dims, allowed dtypes; None = the weights' dtype)
INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = {
    "input_ids": (("num_tokens",), ("int64", "int32")),
    "positions": (("num_tokens",), ("int64", "int32")),
    "hidden_states": (("num_tokens", "hidden_size"), None),
}
GB = 1e9


def check_graph(doc: SourceDoc, spec: RecipeSpec) -> list[Diagnostic]:
    graph, out = spec.graph, []
    for i, op in enumerate(graph.splitting_ops):
        if op not in SPLITTING_OPS:
            message = (
                f"unknown splitting op {op!r}{did_you_mean(op, SPLITTING_OPS)} "
                f"(kiln splits at {' or '.join(SPLITTING_OPS)})"
            )
            out.append(doc.diagnostic("error", message, ("graph", "splitting_ops", i)))
    mode = GraphMode(graph.mode)
    splits = mode.is_graph and mode.splits_forward
    if splits and not graph.splitting_ops:
        message = (
            f"graph.mode {mode} splits the forward into pieces but graph.splitting_ops is empty; add kiln.attention"
        )
        out.append(doc.diagnostic("error", message, ("graph", "splitting_ops")))
    if not splits and graph.splitting_ops and ("graph", "splitting_ops") in doc.values:
        message = f"graph.splitting_ops does nothing under graph.mode {mode} (no piece is split): remove it"
        out.append(doc.diagnostic("error", message, ("graph", "splitting_ops"), key=True))
    seen: dict[int, int] = {}
    for i, size in enumerate(graph.capture_sizes):
        if size in seen:
            line = doc.position(("graph", "capture_sizes", seen[size]))[0]
            message = f"capture size {size} is listed twice (also on line {line})"
            out.append(doc.diagnostic("error", message, ("graph", "capture_sizes", i)))
        seen.setdefault(size, i)
    for i, size in enumerate(graph.compile_sizes or []):
        if size not in seen:
            message = (
                f"compile size {size} is not a capture size {sorted(seen)}: a static compile is only run by "
                "the capture of its size"
            )
            out.append(doc.diagnostic("error", message, ("graph", "compile_sizes", i)))
    if graph.compile_sizes and graph.compiler != "inductor":
        message = f"graph.compile_sizes needs compiler inductor; the {graph.compiler} compiler has no static compiles"
        out.append(doc.diagnostic("error", message, ("graph", "compile_sizes")))
    return out


def check_fusion_groups(doc: SourceDoc, spec: RecipeSpec, model_ops: set[str] | None) -> list[Diagnostic]:
    """Every op of every fusion group exists in the model; no op in two groups; no group spans a split."""
    out: list[Diagnostic] = []
    names: dict[str, int] = {}
    owner: dict[str, str] = {}
    known = None if model_ops is None else sorted(model_ops | set(FUNCTIONAL_OPS))
    for g, group in enumerate(spec.fusion_groups):
        if group.name in names:
            message = f"fusion group name {group.name!r} is used twice (also group {names[group.name]})"
            out.append(doc.diagnostic("error", message, ("fusion_groups", g, "name")))
        names.setdefault(group.name, g)
        for i, op in enumerate(group.ops):
            path = ("fusion_groups", g, "ops", i)
            if op in SPLITTING_OPS or op == "attention":
                message = f"fusion group {group.name}: {op!r} is where graph pieces split; it cannot be fused"
                out.append(doc.diagnostic("error", message, path))
            elif known is not None and op not in known:
                message = (
                    f"fusion group {group.name}: op {op!r} is not in the model{did_you_mean(op, known)} "
                    f"(the model has: {', '.join(known)})"
                )
                out.append(doc.diagnostic("error", message, path))
            elif op in owner and op not in FUNCTIONAL_OPS and owner[op] != group.name:
                message = f"fusion group {group.name}: op {op!r} is already in fusion group {owner[op]}"
                out.append(doc.diagnostic("error", message, path))
            owner.setdefault(op, group.name)
        out += _split_across_attention(doc, g, group.name, group.ops)
    return out


def _split_across_attention(doc: SourceDoc, g: int, name: str, ops: list[str]) -> list[Diagnostic]:
    """An error at the first op that runs on the other side of attention from an earlier op of the group."""
    before = next((op for op in ops if op in BEFORE_ATTENTION), None)
    after = next((op for op in ops if op in AFTER_ATTENTION), None)
    if before is None or after is None:
        return []
    later = max(ops.index(before), ops.index(after))
    message = (
        f"fusion group {name}: {after!r} runs after attention and {before!r} before it; attention splits the graph "
        "between them, so no kernel can hold both: make them two groups"
    )
    return [doc.diagnostic("error", message, ("fusion_groups", g, "ops", later))]


def check_inputs(doc: SourceDoc, spec: RecipeSpec, values: dict[str, int] | None) -> list[Diagnostic]:
    """Declared input tensors: rank, each dimension against the model's value, dtype against the weights."""
    out: list[Diagnostic] = []
    for name, (dims, dtypes) in INPUTS.items():
        tensor = getattr(spec.input_constraints, name)
        if tensor is None:
            continue
        base = ("input_constraints", name)
        if len(tensor.shape) != len(dims):
            message = f"{name}.shape has {len(tensor.shape)} dimensions, expected {len(dims)}: [{', '.join(dims)}]"
            out.append(doc.diagnostic("error", message, (*base, "shape")))
        for i, (dim, expected) in enumerate(zip(tensor.shape, dims, strict=False)):
            problem = _dimension_problem(dim, expected, values or {})
            if problem:
                out.append(doc.diagnostic("error", f"{name}.shape[{i}]: {problem}", (*base, "shape", i)))
        allowed = dtypes or (spec.weights.dtype,)
        if tensor.dtype not in allowed:
            why = (
                f"the model runs in weights.dtype {spec.weights.dtype}"
                if dtypes is None
                else "token ids and positions are integers"
            )
            message = f"{name}.dtype is {tensor.dtype}, expected {' or '.join(allowed)} ({why})"
            out.append(doc.diagnostic("error", message, (*base, "dtype")))
    return out


def _dimension_problem(dim: str | int, expected: str, values: dict[str, int]) -> str | None:
    if isinstance(dim, str) and dim not in SYMBOLS:
        return f"unknown symbol {dim!r}{did_you_mean(dim, SYMBOLS)}"
    if dim == expected:
        return None
    if expected not in MODEL_SYMBOLS:
        return f"expected {expected}, found {dim!r}"
    actual = values.get(dim) if isinstance(dim, str) else dim
    if expected in values and actual is not None and actual != values[expected]:
        found = f"{dim} = {actual}" if isinstance(dim, str) else str(dim)
        return f"found {found} but the model's {expected} is {values[expected]}"
    if isinstance(dim, str) and dim not in MODEL_SYMBOLS:
        return f"expected {expected}, found {dim!r}"
    return None


def check_group_size(doc: SourceDoc, spec: RecipeSpec, config: ModelConfig) -> list[Diagnostic]:
    """Weight-only quantization groups run along each linear layer's input dimension: it must divide them."""
    q = spec.quantization
    if q.weights == "none":
        return []
    dims = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_heads * head_dim": config.q_size,
    }
    bad = [
        f"{name} {value} ({value} % {q.group_size} = {value % q.group_size})"
        for name, value in dims.items()
        if value % q.group_size
    ]
    if not bad:
        return []
    message = f"quantization.group_size {q.group_size} does not divide {' or '.join(bad)}; pick a divisor such as 32"
    return [doc.diagnostic("error", message, ("quantization", "group_size"))]


def check_memory(doc: SourceDoc, spec: RecipeSpec, config: ModelConfig, lora_bytes: int = 0) -> list[Diagnostic]:
    """KV cache (max_pages * block_size * bytes per token) plus weights plus `lora_bytes` (the LoRA adapters' static
    buffers, kiln.recipe.lora_checks.lora_buffer_bytes) must fit hardware.memory_budget_gb."""
    kv = spec.memory_plan.kv_cache
    if kv.dtype != "auto" and kv.dtype not in STORAGE:
        return []  # refused by kiln.recipe.contract.check_refused
    kv_dtype = kv_storage_dtype(kv.dtype, parse_dtype(spec.weights.dtype))
    per_token = config.kv_bytes_per_token(kv_dtype)
    kv_bytes = kv.max_pages * kv.block_size * per_token
    weight_bytes = weights_bytes(spec, config)
    budget = spec.hardware.memory_budget_gb
    if kv_bytes + weight_bytes + lora_bytes <= budget * GB:
        return []
    stored = kv_dtype_name(kv_dtype)
    message = (
        f"memory_budget_gb {budget:g} is too small: the KV cache needs {kv_bytes / GB:.2f} GB "
        f"(max_pages {kv.max_pages} x block_size {kv.block_size} x {per_token} bytes per token as {stored}) "
        f"and the weights {weight_bytes / GB:.2f} GB ({spec.weights.dtype}, quantization "
        f"{spec.quantization.weights})"
        + (f" and the LoRA buffers {lora_bytes / GB:.2f} GB (lora.max_loras x lora.max_rank)" if lora_bytes else "")
        + f": {(kv_bytes + weight_bytes + lora_bytes) / GB:.2f} GB in all; lower max_pages or raise the budget"
    )
    return [doc.diagnostic("error", message, ("hardware", "memory_budget_gb"))]


def check_kv_dtype(doc: SourceDoc, spec: RecipeSpec, config: ModelConfig) -> list[Diagnostic]:
    """int8 and fp8_e4m3 rows end in a float32 scale (kiln.model.kv_format), aligned only for a head dim that is a
    multiple of 4."""
    kv = spec.memory_plan.kv_cache
    if kv.dtype not in STORAGE or not is_scaled(STORAGE[kv.dtype]) or config.head_dim % 4 == 0:
        return []
    message = (
        f"memory_plan.kv_cache.dtype: {kv.dtype} needs a head dim that is a multiple of 4 (each row's float32 scale "
        f"follows its codes), but the model's is {config.head_dim}; use bfloat16 or float16"
    )
    return [doc.diagnostic("error", message, ("memory_plan", "kv_cache", "dtype"))]


def weights_bytes(spec: RecipeSpec, config: ModelConfig) -> int:
    """Bytes of the weights at run time; linear layers shrink under int8/int4 (plus one scale per group)."""
    itemsize = parse_dtype(spec.weights.dtype).itemsize
    h, layers = config.hidden_size, config.num_layers
    linear = layers * (
        h * config.q_size + 2 * h * config.kv_size + config.q_size * h + 3 * h * config.intermediate_size
    )
    other = config.num_params() - linear
    bits = {"none": 8 * itemsize, "int8": 8, "int4": 4}[spec.quantization.weights]
    scales = 0 if spec.quantization.weights == "none" else linear // spec.quantization.group_size * itemsize
    return int(linear * bits // 8 + scales + other * itemsize)
