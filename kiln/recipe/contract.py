"""Every recipe field acts or is refused: the fields kiln does not execute (yet) are errors at their line, and the
hardware the recipe asks for is checked against the machine that runs it (kiln.recipe.machine).

What each field does is listed in recipes/README.md; the engine reads the honoured ones from the Recipe.
"""

from __future__ import annotations

import os
import re

from kiln.config import ModelConfig
from kiln.graph_mode import GraphMode
from kiln.model.loader import CheckpointHeader
from kiln.quant.gguf_blocks import GROUP
from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.machine import CPU_ARCHES, CUDA_ARCH, Machine
from kiln.recipe.schema import HF_QUANTIZATIONS, RecipeSpec
from kiln.recipe.source import SourceDoc

# A size written in a model name ("135m", "7b", "1.5B") may differ from the parameter count by this factor
# (names round, and tied embeddings are counted once or twice).
SIZE_TOLERANCE = 1.35


def quantization_mode(spec: RecipeSpec) -> str:
    """How the engine runs the recipe's weights (EngineConfig.quantization): int4 over a Q4_0/Q4_1/Q4_K file, or
    int8 over a Q8_0/Q5_K/Q6_K one, keeps the file's blocks ("packed"); otherwise int8/int4 quantize at load."""
    weights, source = spec.quantization.weights, spec.weights.source_quantization
    if weights == "none":
        return "none"
    same = {"int4": ("q4_0", "q4_1", "q4_k", "int4"), "int8": ("q8_0", "q5_k", "q6_k", "int8")}[weights]
    return "packed" if source in same else weights


def _check_quantization(doc: SourceDoc, spec: RecipeSpec) -> list[Diagnostic]:
    """The quantization section against the checkpoint's weights and the device."""
    out = []
    q = spec.quantization
    source = spec.weights.source_quantization
    file_group = 16 if source == "q6_k" else GROUP
    # NOTE: a quantized HF checkpoint's own groups run packed (any size); quantization.group_size is not theirs
    from_hf = source in HF_QUANTIZATIONS
    if from_hf and q.weights not in ("none", source):
        keep = source if source != "fp8" else "none"
        message = (
            f"quantization.weights: {q.weights} contradicts weights.source_quantization: {source} (what the "
            f"checkpoint's quantization_config says it holds): kiln runs a quantized checkpoint's weights as stored "
            f"or dequantized, never quantized again; set quantization.weights: {keep}"
        )
        out.append(doc.diagnostic("error", message, ("quantization", "weights")))
    elif quantization_mode(spec) == "packed" and not from_hf and q.group_size != file_group:
        message = (
            f"quantization.group_size {q.group_size} is not what runs: the file's {spec.weights.source_quantization} "
            f"blocks stay packed in their own groups of {file_group}; set group_size: {file_group}"
        )
        out.append(doc.diagnostic("error", message, ("quantization", "group_size")))
    elif q.weights != "none" and q.group_size % 2:
        message = f"quantization.group_size {q.group_size} is odd: kiln stores 4-bit codes two to a byte; pick 32"
        out.append(doc.diagnostic("error", message, ("quantization", "group_size")))
    elif q.weights == "none" and ("quantization", "group_size") in doc.values:
        message = (
            "quantization.group_size does nothing without quantized weights (quantization.weights is none): it sizes "
            "the groups of weights kiln quantizes at load; remove it"
        )
        out.append(doc.diagnostic("error", message, ("quantization", "group_size")))
    # NOTE: float32 activations are what unquantized weights run with anyway: never refused (as --activations)
    quantized_activations = q.activations != "float32"
    if (
        ("quantization", "activations") in doc.values
        and quantized_activations
        and (q.weights == "none" or spec.hardware.device != "cpu")
    ):
        why = "without quantized weights (quantization.weights is none)" if q.weights == "none" else "on cuda"
        message = (
            f"quantization.activations does nothing {why}: it sets the activations of kiln's CPU kernels for "
            "packed products; remove it"
        )
        out.append(doc.diagnostic("error", message, ("quantization", "activations")))
    return out


def check_refused(doc: SourceDoc, spec: RecipeSpec) -> list[Diagnostic]:
    """Fields whose value kiln would silently not honour."""
    out = _check_quantization(doc, spec)
    kv = spec.memory_plan.kv_cache
    if kv.dtype in ("fp8", "fp8_e5m2"):
        message = (
            f"memory_plan.kv_cache.dtype: {kv.dtype} is not supported: kiln stores an fp8 KV cache as e4m3 codes "
            "with a scale per token and head; set dtype: fp8_e4m3 (or int8, bfloat16, auto)"
        )
        out.append(doc.diagnostic("error", message, ("memory_plan", "kv_cache", "dtype")))
    if kv.layout != "paged":
        message = (
            f"memory_plan.kv_cache.layout: {kv.layout} is not supported: kiln's KV cache is paged "
            "(block_size tokens per page); set layout: paged"
        )
        out.append(doc.diagnostic("error", message, ("memory_plan", "kv_cache", "layout")))
    if not spec.memory_plan.activation_reuse:
        message = (
            "memory_plan.activation_reuse: false is not supported: captured pieces always share static buffers "
            "between sizes; remove it or set it to true"
        )
        out.append(doc.diagnostic("error", message, ("memory_plan", "activation_reuse")))
    graph = spec.graph
    untraced = untraced_because(spec)
    if spec.debug.debug_mode and untraced:
        message = f"debug.debug_mode traces graph-mode pieces, but {untraced}: there is nothing to trace"
        out.append(doc.diagnostic("error", message, ("debug", "debug_mode")))
    if untraced or graph.compiler != "inductor":
        why = untraced or f"graph.compiler is {graph.compiler}"
        for g, group in enumerate(spec.fusion_groups):
            severity = "error" if group.required else "warning"
            message = f"fusion group {group.name} cannot be realised: {why}, so no code is generated to fuse it" + (
                "; use a graph mode with the inductor compiler or set required: false" if group.required else ""
            )
            out.append(doc.diagnostic(severity, message, ("fusion_groups", g)))
    for name in ("input_ids", "positions"):
        tensor = getattr(spec.input_constraints, name)
        if tensor is not None and tensor.dtype == "int32":
            message = f"input_constraints.{name}.dtype: int32 is not supported: kiln feeds {name} as int64"
            out.append(doc.diagnostic("error", message, ("input_constraints", name, "dtype")))
    return out


def untraced_because(spec: RecipeSpec) -> str | None:
    """Why no graph piece is traced under this recipe (None: pieces are traced)."""
    return None if GraphMode(spec.graph.mode).is_graph else "graph.mode is eager"


GRAPH_ONLY_FIELDS = ("capture_sizes", "compile_sizes", "compiler")
SPECULATION_TUNING = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "policy")
NGRAM_ONLY = ("prompt_lookup_max", "prompt_lookup_min")


def check_inert(doc: SourceDoc, spec: RecipeSpec) -> list[Diagnostic]:
    """Fields written in the recipe that would do nothing, as the engine flags of the same names are refused
    (kiln.engine.setup.inert_options): the graphs' sizes and compiler under graph.mode eager, the second forms' memory
    without packed or quantized weights on the CPU, speculation's tuning with no method (or the ngram method's with
    another). graph.splitting_ops where nothing is split is refused beside the other graph checks (sections.py)."""
    out = []
    if spec.graph.mode == "eager":
        for name in GRAPH_ONLY_FIELDS:
            if ("graph", name) in doc.values:
                message = f"graph.{name} does nothing under graph.mode eager (no piece is traced): remove it"
                out.append(doc.diagnostic("error", message, ("graph", name)))
    if ("memory_plan", "second_form_memory_gb") in doc.values and (
        quantization_mode(spec) == "none" or spec.hardware.device != "cpu"
    ):
        message = (
            "memory_plan.second_form_memory_gb does nothing without packed or quantized weights on the CPU "
            "(quantization.weights is none, or a cuda device): remove it"
        )
        out.append(doc.diagnostic("error", message, ("memory_plan", "second_form_memory_gb")))
    method = spec.speculative.method
    tuned = [name for name in SPECULATION_TUNING if ("speculative", name) in doc.values]
    for name in tuned:
        if method is None:
            message = f"speculative.{name} does nothing without speculative.method (speculation is off): set one"
        elif method != "ngram" and name in NGRAM_ONLY:
            message = f"speculative.{name} tunes the ngram method only, not {method}: remove it"
        else:
            continue
        out.append(doc.diagnostic("error", message, ("speculative", name)))
    return out


def check_hardware(doc: SourceDoc, spec: RecipeSpec, machine: Machine) -> list[Diagnostic]:
    """`hardware.device` must exist here; `hardware.arch` must name a known ISA or CUDA arch that this machine has."""
    hw, out = spec.hardware, []
    if hw.device == "cuda" and machine.cuda is None:
        cpu = machine.cpu_summary()
        message = f"kiln runs on CPU here (no CUDA device is visible: {cpu}); this recipe asks for cuda"
        out.append(doc.diagnostic("error", message, ("hardware", "device")))
    arch = hw.arch
    if arch is None:
        return out
    path = ("hardware", "arch")
    cuda = CUDA_ARCH.match(arch)
    if cuda is None and arch not in CPU_ARCHES:
        message = (
            f"hardware.arch {arch!r} is not an architecture kiln can check: use a CPU ISA "
            f"({', '.join(CPU_ARCHES)}) or a CUDA arch such as sm_80, sm_90; or null for any"
        )
        return [*out, doc.diagnostic("error", message, path)]
    if hw.device == "cpu":
        if cuda is not None:
            message = f"hardware.arch {arch} is a CUDA architecture but hardware.device is cpu"
            out.append(doc.diagnostic("error", message, path))
        elif not machine.has_cpu_arch(arch):
            message = f"hardware.arch {arch}: this CPU does not have it: {machine.cpu_summary()}"
            out.append(doc.diagnostic("error", message, path))
        return out
    if cuda is None:
        message = f"hardware.arch {arch} is a CPU ISA but hardware.device is cuda; use sm_XX"
        out.append(doc.diagnostic("error", message, path))
    elif machine.cuda is not None and machine.cuda < (int(cuda.group(1)), int(cuda.group(2))):
        have = f"sm_{machine.cuda[0]}{machine.cuda[1]}"
        message = f"hardware.arch {arch}: the CUDA device here is {machine.cuda_name} ({have}), older than {arch}"
        out.append(doc.diagnostic("error", message, path))
    return out


def check_identity(doc: SourceDoc, spec: RecipeSpec, header: CheckpointHeader) -> list[Diagnostic]:
    """`model.name` (its family and any size in it) and `model.architecture` against the checkpoint's metadata."""
    config, out = header.config, []
    file = os.path.basename(header.path)
    params = config.num_params()
    what = f"{file} is {config.name or file!r} ({config.architecture}, {params / 1e6:.1f}M parameters)"
    arch = spec.model.architecture
    if arch is not None and _squash(config.architecture) not in _squash(arch):
        message = f"model.architecture {arch!r} does not match the checkpoint: {what}"
        out.append(doc.diagnostic("error", message, ("model", "architecture")))
    out += _check_experts(doc, spec, config, what)
    name = spec.model.name
    family = _family(name)
    known = _squash(f"{config.name} {file} {os.path.basename(os.path.dirname(header.path))}")
    size = _size(name)
    wrong_family = family is not None and family not in known
    wrong_size = size is not None and not (1 / SIZE_TOLERANCE <= size / params <= SIZE_TOLERANCE)
    if wrong_family or wrong_size:
        why = f"'{family}' is not in its name" if wrong_family else f"{size / 1e6:g}M parameters is not its size"
        message = f"model.name {name!r} does not match the checkpoint ({why}): {what}; fix model.name or model.path"
        out.append(doc.diagnostic("error", message, ("model", "name")))
    return out


def _check_experts(doc: SourceDoc, spec: RecipeSpec, config: ModelConfig, what: str) -> list[Diagnostic]:
    """`model.num_experts` and `model.top_k` against the checkpoint's mixture-of-experts layers."""
    out = []
    for field, stated, actual in (
        ("num_experts", spec.model.num_experts, config.num_experts),
        ("top_k", spec.model.top_k, config.num_experts_per_tok),
    ):
        if stated is None or stated == actual:
            continue
        has = f"{actual} ({what})" if actual else f"no mixture-of-experts layers ({what})"
        message = f"model.{field} is {stated}, but the checkpoint has {has}"
        out.append(doc.diagnostic("error", message, ("model", field)))
    return out


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _family(name: str) -> str | None:
    """The leading word of a model name ("smollm2" of "SmolLM2-135M-Instruct"); None if it has none."""
    match = re.match(r"[^a-zA-Z]*([a-zA-Z][a-zA-Z0-9]*)", name)
    return _squash(match.group(1)) if match else None


def _size(name: str) -> float | None:
    """Parameters named in a model name: 135M -> 1.35e8, 1.5b -> 1.5e9; None when it names none."""
    match = re.search(r"(?<![a-zA-Z0-9.])(\d+(?:\.\d+)?)([mMbB])(?![a-zA-Z])", name)
    if match is None:
        return None
    return float(match.group(1)) * (1e6 if match.group(2) in "mM" else 1e9)
