"""Checks against the checkpoint, from its headers only: stored tensor types, model symbols, module names."""

from __future__ import annotations

import os
from collections import Counter
from functools import lru_cache

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.model.loader import CheckpointHeader, read_checkpoint_header, resolve_model_path
from kiln.model.loader.base import FileVersion, file_version
from kiln.model.loader.families import gguf_layout
from kiln.model.loader.gguf_layout import hf_tensors
from kiln.recipe.constraints import Constraint
from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.evaluate import evaluate
from kiln.recipe.expr import ExprError
from kiln.recipe.schema import GGUF_QUANTIZATIONS, HF_QUANTIZATIONS, RecipeSpec
from kiln.recipe.source import SourceDoc

# stored type (a GGUF tensor type; a quantized HF layer's "INT4" ...) -> what weights.source_quantization calls it
QUANTIZED = {t.upper(): t for t in (*GGUF_QUANTIZATIONS, *HF_QUANTIZATIONS)}
FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def model_symbols(config: ModelConfig) -> dict[str, int]:
    """The model symbols a recipe may use, bound to the checkpoint's values."""
    return {
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "num_layers": config.num_layers,
        "num_experts": config.num_experts,
        "top_k": config.num_experts_per_tok,
    }


def open_header(doc: SourceDoc, spec: RecipeSpec, override: str | None) -> tuple[CheckpointHeader | None, list]:
    """The checkpoint header (cached by path, size and mtime), or a diagnostic at `model.path` saying why not."""
    model = override if override is not None else spec.model.path
    if override is None and model not in ("", "default") and not os.path.isabs(model) and doc.file != "<string>":
        model = os.path.join(os.path.dirname(doc.file), model)
    try:
        return read_header(model), []
    except (KilnError, OSError) as exc:
        where = "--model" if override is not None else "model.path"
        message = f"{where}: cannot read the checkpoint: {exc}"
        return None, [doc.diagnostic("error", message, ("model", "path"))]


def read_header(model: str | None) -> CheckpointHeader:
    """`read_checkpoint_header`, cached while the file's size and mtime stay the same."""
    path = resolve_model_path(model)
    return _read_header(path, file_version(path))


@lru_cache(maxsize=8)
def _read_header(path: str, version: FileVersion) -> CheckpointHeader:
    return read_checkpoint_header(path)


def check_weights(doc: SourceDoc, spec: RecipeSpec, header: CheckpointHeader) -> list[Diagnostic]:
    """`weights.dtype` / `source_quantization` against the tensor types the file really holds."""
    stored = layer_storage_type(header)
    holds = f"{os.path.basename(header.path)} holds {_summary(Counter(header.tensor_types.values()))}"
    claimed_q, dtype = spec.weights.source_quantization, spec.weights.dtype
    unsupported = sorted(set(header.tensor_types.values()) - set(QUANTIZED) - set(FLOATS))
    if unsupported:
        return [
            doc.diagnostic(
                "error",
                f"{holds}; kiln cannot dequantize {', '.join(unsupported)} "
                f"(it reads {', '.join([*FLOATS, *QUANTIZED])})",
                ("model", "path"),
            )
        ]
    if stored in QUANTIZED and claimed_q == "none":
        path = (
            ("weights", "source_quantization")
            if ("weights", "source_quantization") in doc.values
            else ("weights", "dtype")
        )
        message = (
            f"weights.dtype: {dtype} claims the checkpoint holds {dtype} weights, but {holds}; "
            f"set weights.source_quantization: {QUANTIZED[stored]} (kiln dequantizes to weights.dtype)"
        )
        return [doc.diagnostic("error", message, path)]
    if claimed_q != "none" and QUANTIZED.get(stored) != claimed_q:
        fix = f"set it to {QUANTIZED[stored]}" if stored in QUANTIZED else "set it to none"
        message = f"weights.source_quantization: {claimed_q}, but {holds}; {fix}"
        return [doc.diagnostic("error", message, ("weights", "source_quantization"))]
    if stored in FLOATS and dtype not in (FLOATS[stored], "float32"):
        message = (
            f"weights.dtype: {dtype}, but {holds}; converting {stored} weights to {dtype} can overflow "
            f"(inf/NaN) or lose precision: use {FLOATS[stored]} or float32"
        )
        return [doc.diagnostic("error", message, ("weights", "dtype"))]
    return []


def layer_storage_type(header: CheckpointHeader) -> str:
    """The storage type of most linear-layer weights ("Q4_1", "BF16", ...): what `source_quantization` describes."""
    layer_types = Counter(t for name, t in header.tensor_types.items() if _module(header, name).endswith("_proj"))
    if not layer_types:
        layer_types = Counter(header.tensor_types.values())
    return layer_types.most_common(1)[0][0] if layer_types else "F32"


def check_model_constraints(
    doc: SourceDoc, constraints: list[Constraint], values: dict[str, int], header: CheckpointHeader
) -> list[Diagnostic]:
    """Constraints over model symbols only (`hidden_size == 512`) are facts about the checkpoint: check them."""
    diagnostics = []
    for c in constraints:
        if not c.is_model_only:
            continue
        shown = ", ".join(f"{s}={values[s]}" for s in sorted(c.expr.symbols))
        try:
            holds = evaluate(c.expr, values)
        except ExprError as exc:
            message = f"{exc.message} for this model ({shown})"
            diagnostics.append(doc.at("error", message, line=c.line, col=c.column(exc.offset), length=exc.length))
            continue
        if not holds:
            message = f"{c.text} is false for this model: {shown} in {os.path.basename(header.path)}"
            diagnostics.append(doc.at("error", message, line=c.line, col=c.col, length=len(c.text)))
    return diagnostics


def checkpoint_modules(header: CheckpointHeader) -> set[str]:
    """Module names the checkpoint's tensors belong to (q_proj, gate_proj, norm, ...), by their HF names."""
    return {_module(header, name) for name in header.tensor_types} - {""}


def model_ops(header: CheckpointHeader) -> set[str]:
    """Module names the checkpoint has (q_proj, gate_proj, norm, ...), plus kiln's fused ones."""
    ops = checkpoint_modules(header)
    if header.config.tie_word_embeddings:
        ops.add("lm_head")
    if {"q_proj", "k_proj", "v_proj"} <= ops:
        ops.add("qkv_proj")
    if {"gate_proj", "up_proj"} <= ops:
        ops.add("gate_up_proj")
    return ops


def _module(header: CheckpointHeader, name: str) -> str:
    """The module a checkpoint tensor belongs to, by its HF name (a GGUF tensor's in its family's naming)."""
    hf: str | None = name
    if header.format == "gguf":
        found = hf_tensors(gguf_layout(header.config.architecture), name, header.tensor_shapes.get(name, ()))
        hf = found[0].name if found else None
    parts = (hf or "").split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _summary(types: Counter) -> str:
    items = types.most_common()
    return ", ".join(f"{t} ({n} tensor{'s' if n != 1 else ''})" for t, n in items)
