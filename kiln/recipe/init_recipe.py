"""`kiln recipe init`: a valid, commented recipe for a checkpoint, derived from its header; with `--enable-lora`, a
`lora:` section sized by `--max-loras` / `--max-lora-rank` (targets: `--lora-target-modules`, else every layer)."""

from __future__ import annotations

import math
import os
import re

from kiln.config import LoRAConfig
from kiln.errors import ConfigError
from kiln.lora.targets import TARGET_MODULES
from kiln.model.dtypes import parse_dtype
from kiln.model.loader import CheckpointHeader, resolve_model_path
from kiln.recipe.checkpoint import QUANTIZED, checkpoint_modules, layer_storage_type, model_ops, read_header
from kiln.recipe.lora_checks import lora_buffer_bytes
from kiln.recipe.recipe import load_recipe_text
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.sections import GB, weights_bytes

MAX_TOKENS, MAX_SEQS, BLOCK_SIZE, MIN_PAGES = 2048, 64, 16, 1024

TEMPLATE = """\
# kiln recipe for {title}, written by `kiln recipe init`.
# Validate it with: kiln recipe validate {out}
recipe_version: 1
model: {{name: {name}, path: {path}, layer_type: decoder}}

input_constraints:
  hidden_states: {{shape: [num_tokens, hidden_size], dtype: float32}}
  constraints:  # Python syntax over named symbols; proven consistent, enforced at run time
    - num_tokens <= {max_tokens}  # tokens in one forward
    - seq_len <= {max_len}  # prompt + generated tokens of one sequence
    - batch_size <= {max_seqs}  # sequences in one step
    - batch_size <= num_tokens  # every scheduled sequence contributes at least one token

weights: {{dtype: float32, source_quantization: {source}}}  # the file stores {stored}
quantization: {{weights: none}}
{fusion}
memory_plan:
  kv_cache: {{dtype: float32, layout: paged, block_size: {block_size}, max_pages: {max_pages}}}  # {kv_gb:.2f} GB
  activation_reuse: true
{lora}
graph:
  mode: full_and_piecewise
  splitting_ops: [kiln.attention]
  capture_sizes: [1, 2, 4, 8, 16, 32]
  compiler: inductor
hardware: {{device: cpu, arch: null, memory_budget_gb: {budget}}}  # weights {weights_gb:.2f} GB + KV cache{lora_budget}
debug: {{debug_mode: false}}
"""


LORA_SECTION = """
lora:  # LoRA adapters (kiln serve --enable-lora): static buffers of {lora_gb:.3f} GB, fixed at start
  max_loras: {max_loras}  # adapters held at once, one buffer slot each (--max-loras)
  max_rank: {max_rank}  # highest adapter rank accepted: the buffers' width (--max-lora-rank)
  target_modules: {targets}  # {targets_note}
  dtype: {dtype}  # the buffers' dtype (--lora-dtype; auto: the weights')
"""


def init_recipe_text(model: str | None, out: str | None = None, lora: LoRAConfig | None = None) -> str:
    """Recipe text for `model`, validated before it is returned; `out` is where it will be written (relative
    model paths are made relative to it); `lora` (enabled): a `lora:` section of its sizes and target modules."""
    header = read_header(model)
    config = header.config
    stored = layer_storage_type(header)
    max_len = min(config.max_position_embeddings, MAX_TOKENS)
    max_pages = max(MIN_PAGES, math.ceil(max_len / BLOCK_SIZE))
    kv_bytes = max_pages * BLOCK_SIZE * config.kv_bytes_per_token(parse_dtype("float32"))
    spec = RecipeSpec.model_validate({"recipe_version": 1, "model": {"name": "x"}, "hardware": {"device": "cpu"}})
    weight_bytes = weights_bytes(spec, config)
    lora_text, lora_bytes = _lora_section(header, lora) if lora is not None and lora.enabled else ("", 0)
    ops = model_ops(header)
    fusion = (
        "\nfusion_groups:\n  - {name: mlp_fusion, ops: [gate_proj, up_proj, silu, mul]}\n"
        if {"gate_proj", "up_proj", "down_proj"} <= ops
        else ""
    )
    text = TEMPLATE.format(
        title=config.name or os.path.basename(header.path),
        out=out or "recipe.yaml",
        name=_slug(config.name, header.path),
        path=_path_for(model, out),
        max_tokens=MAX_TOKENS,
        max_len=max_len,
        max_seqs=MAX_SEQS,
        source=QUANTIZED.get(stored, "none"),
        stored=stored,
        fusion=fusion,
        block_size=BLOCK_SIZE,
        max_pages=max_pages,
        kv_gb=kv_bytes / GB,
        weights_gb=weight_bytes / GB,
        lora=lora_text,
        lora_budget=" + LoRA buffers" if lora_text else "",
        budget=max(8, math.ceil(1.25 * (kv_bytes + weight_bytes + lora_bytes) / GB)),
    )
    load_recipe_text(text, out or "<string>")
    return text


def _lora_section(header: CheckpointHeader, lora: LoRAConfig) -> tuple[str, int]:
    """The `lora:` section for `lora`'s sizes and targets, and its buffers' bytes; ConfigError naming
    --lora-target-modules for a module kiln does not adapt or the checkpoint lacks."""
    modules = checkpoint_modules(header)
    has = sorted(modules & set(TARGET_MODULES), key=TARGET_MODULES.index)
    for name in lora.target_modules or ():
        if name not in TARGET_MODULES:
            raise ConfigError(
                f"--lora-target-modules: {name} is not a layer kiln adapts "
                f"(expected some of {', '.join(TARGET_MODULES)})"
            )
        if name not in modules:
            raise ConfigError(
                f"--lora-target-modules: {name} is not a layer of {header.path} (it has {', '.join(has)})"
            )
    section = {"max_loras": lora.max_loras, "max_rank": lora.max_lora_rank, "dtype": lora.dtype}
    if lora.target_modules is not None:
        section["target_modules"] = list(lora.target_modules)
    spec = RecipeSpec.model_validate(
        {"recipe_version": 1, "model": {"name": "x"}, "hardware": {"device": "cpu"}, "lora": section}
    )
    lora_bytes = lora_buffer_bytes(spec, header.config, modules)
    given = lora.target_modules is not None
    text = LORA_SECTION.format(
        lora_gb=lora_bytes / GB,
        max_loras=lora.max_loras,
        max_rank=lora.max_lora_rank,
        dtype=lora.dtype,
        targets=f"[{', '.join(lora.target_modules or ())}]" if given else "null",
        targets_note="the only layers adapters may adapt" if given else f"any of this checkpoint's: {', '.join(has)}",
    )
    return text, lora_bytes


def _path_for(model: str | None, out: str | None) -> str:
    if model in (None, "", "default"):
        return "default"
    path = os.path.abspath(resolve_model_path(model))
    if out is not None:
        path = os.path.relpath(path, os.path.dirname(os.path.abspath(out)))
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _slug(name: str, path: str) -> str:
    base = name or os.path.splitext(os.path.basename(path))[0]
    return re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-") or "model"
