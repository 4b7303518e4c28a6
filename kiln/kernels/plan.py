"""`plan_kernels(model, ...)`: one engine's kernel plan, the same call for the eager and the graph executor.

A plan holds every kernel choice that makes the same model compute the same numbers faster on this machine:
- the static compile sizes (graph mode on CPU: row counts whose products become GEMV reductions,
  kiln.kernels.static_sizes), configured or timed;
- the decoder weights' layout for one row (kiln.kernels.layout), row-major whenever GEMV reductions need it;
- the one-row logits head (a transposed copy when it streams faster, kiln.kernels.head);
- the packed products' kernel table (kiln.kernels.packed), one winner per layout and row count;
- bf16 decoder layers' products: `F.linear` or oneDNN on a prepacked copy, per layout and row count
  (kiln.kernels.dense);
- decode and prefill attention's kernels (kiln.kernels.attention): the torch forms or kiln's native paged kernels;
- the LoRA products of few rows, per adapted layer's geometry (kiln.kernels.lora): gathered torch or native.

Every choice is timed here and cached per machine and process (kiln.kernels.choices): two engines over one model
make the same plan. `plan.install(model)` lays the weights out and binds the packed winners to the layers; the
plan lives on the engine's executor, never in a module of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.compile.compiler import PieceCompiler, make_compiler
from kiln.compile.passes import GEMV_MAX_ROWS
from kiln.config import DEFAULT_ACTIVATIONS
from kiln.kernels.attention import (
    TORCH,
    choose_decode_attention,
    choose_prefill_attention,
    decode_kernel,
    prefill_kernel,
)
from kiln.kernels.candidates import FLOAT32
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.dense import DenseKernelTable, dense_layers, prepacking_runs
from kiln.kernels.head_forms import HeadFormTable, float_head, head_candidates
from kiln.kernels.head_kernels import AS_LOADED
from kiln.kernels.inductor_isa import trust_recorded_probe
from kiln.kernels.layout import (
    ROW_MAJOR,
    fastest_one_row_layout,
    largest_layer_weight,
    one_row_head,
    set_layer_weight_layout,
)
from kiln.kernels.lora import LoRAKernelPlan
from kiln.kernels.packed import ROWS, PackedKernelTable, packed_layers, timed_rows
from kiln.kernels.static_sizes import choose_static_sizes
from kiln.model.forward_context import DecodeKernel, PrefillKernel
from kiln.model.graph_attention import traced_decode_attention
from kiln.model.prefill_attention import grouped_prefill_attention
from kiln.platforms import platform_of
from kiln.quant.ops import rows_label

logger = logging.getLogger("kiln")

SECOND_FORM_SHARE = 0.5  # second forms may take this share of the memory free at install (the default budget)
PACKED = "packed"  # the decoder layout of a model whose decoder weights are all packed: nothing to lay out


@dataclass
class KernelPlan:
    static_sizes: tuple[int, ...] = ()  # capture sizes also compiled for their static num_tokens
    decoder_layout: str | None = None  # row-major | column-major | packed; None: left as loaded (not on CPU)
    head_t: torch.Tensor | None = None  # [hidden, vocab] head copy for one-row logits, when BLAS gains that way
    packed: PackedKernelTable | None = None
    dense: DenseKernelTable | None = None  # bf16 decoder layers' prepacked oneDNN products, where they run
    head_forms: HeadFormTable | None = None  # a float32 head's timed second form, where one was a candidate
    decode_attention: str = TORCH  # its kernel's name: the torch form or a native one (kiln.kernels.attention)
    prefill_attention: str = TORCH  # the prompts' attention kernel's name, likewise
    lora: LoRAKernelPlan | None = None  # the few-row LoRA forms, where the model has LoRA layers and a native kernel
    # the most memory second forms of packed weights may take (kiln.kernels.compute_forms); None: SECOND_FORM_SHARE
    # of the memory free when the plan is installed (after the weights and the KV cache)
    second_form_gb: float | None = None
    second_form_bytes: int = 0  # what the installed second forms take
    # what was timed (or read from the cache), for logs and kernel_profile.json
    choices: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def decode_kernel(self) -> DecodeKernel | None:
        """What the step's forward context hands to attention (None: the torch form)."""
        return decode_kernel(self.decode_attention)

    @property
    def prefill_kernel(self) -> PrefillKernel | None:
        """What the step's forward context hands to attention for prompts (None: the grouped torch form)."""
        return prefill_kernel(self.prefill_attention)

    @property
    def gemv_sizes(self) -> list[int]:
        return [s for s in self.static_sizes if s <= GEMV_MAX_ROWS]

    def install(self, model: nn.Module) -> None:
        """Lay out `model`'s decoder weights (strides only, never values) and bind the packed winners and the head's
        second form."""
        if self.decoder_layout not in (None, PACKED):
            set_layer_weight_layout(model, self.decoder_layout)
        cpu = torch.device("cpu")  # (second forms and prepacked products are CPU copies)
        free = platform_of(cpu).available_memory_gb(cpu) * 1e9
        budget = SECOND_FORM_SHARE * free if self.second_form_gb is None else self.second_form_gb * 1e9
        if self.packed is not None:
            self.second_form_bytes = self.packed.install(budget)
            if self.packed.second_forms or self.packed.over_budget:
                logger.info(
                    "Second forms: %s; %.1f MB of a %.0f MB budget (%s)",
                    self.packed.second_form_summary(),
                    self.second_form_bytes / 2**20,
                    budget / 2**20,
                    self._budget_source(),
                )
        if self.lora is not None:
            self.lora.install(model)
            logger.info("LoRA products of few rows: %s", self.lora.summary())
        if self.head_forms is not None:
            spent = self.head_forms.install(budget - self.second_form_bytes)
            self.second_form_bytes += spent
            if self.head_forms.kernel(1) is not None:
                self.head_t = None  # one row runs the second form: no column-major copy is kept
            logger.info("Logits head: %s (second forms budget: %s)", self.head_forms.summary(), self._budget_source())
        free -= self.second_form_bytes
        if self.dense is not None:
            copies = self.dense.install(free)
            if copies:
                logger.info("Dense kernels: %s (prepacked copies: %.1f MB)", self.dense.summary(), copies / 2**20)

    def _budget_source(self) -> str:
        if self.second_form_gb is not None:
            return "--second-form-memory-gb"
        return f"{SECOND_FORM_SHARE:.0%} of the memory free after the weights and the KV cache"


def plan_kernels(
    model: nn.Module,
    cache_root: Path,
    compiler: PieceCompiler | None = None,
    capture_sizes: Sequence[int] = (),
    configured_sizes: Sequence[int] | None = (),
    activations: str = DEFAULT_ACTIVATIONS,
    kv_caches: Sequence[torch.Tensor] = (),
    head_rows: int | None = None,
    second_form_gb: float | None = None,
) -> KernelPlan:
    """The plan for `model` on this machine. `compiler` compiles the static sizes and the compiled candidates
    (the inductor compiler when None, or when it cannot compile for static shapes); `configured_sizes` are the
    static compile sizes when given (the eager executor gives none), else they are timed for the one- and
    two-row `capture_sizes`. `activations` (int8x2 | int8 | float32, kiln.config.ACTIVATION_NAMES) says which
    packed candidates may be timed; decode attention's kernel is timed over the geometry of `kv_caches` (the
    first layer's that holds heads; none given: the torch form); `head_rows`, the most rows the engine samples in
    one step (None: no bound), bounds the row counts a packed logits head is timed at; `second_form_gb` bounds the
    memory of second forms of packed weights (None: SECOND_FORM_SHARE of the memory free at install; 0: none are
    timed)."""
    cpu = next(model.parameters()).device.type == "cpu"
    if cpu:
        trust_recorded_probe()  # before the first compile: inductor's ISA probe, run at install (inductor_isa.py)
    compiler = compiler or make_compiler("inductor")
    kernel_compiler = compiler if compiler.supports_static_sizes else make_compiler("inductor")
    cache = KernelChoiceCache(cache_root)
    plan = KernelPlan(second_form_gb=second_form_gb)
    weight = largest_layer_weight(model)
    if cpu and packed_layers(model):  # their one- and two-row choices live in the op: no static sizes for them
        plan.packed = PackedKernelTable(
            model,
            kernel_compiler,
            cache,
            activations=activations,
            head_rows=head_rows,
            second_forms=second_form_gb != 0,
        )
        plan.choices["packed_kernels"] = plan.packed.records
    if configured_sizes is not None:
        plan.static_sizes = tuple(sorted(configured_sizes))
    elif weight is not None and cpu and compiler.supports_static_sizes:
        record = choose_static_sizes(weight, list(capture_sizes), compiler, cache)
        plan.choices["static_sizes"] = record
        plan.static_sizes = tuple(int(s) for s in list(record["static_sizes"]))
    if not cpu:
        return plan
    held = next((c for c in kv_caches if c.shape[1] > 0), None)
    if held is not None:
        config = model.config
        num_heads = held.shape[1] * (config.num_heads // config.num_kv_heads)  # this rank's query heads
        plan.decode_attention, plan.choices["decode_attention"] = choose_decode_attention(
            held, num_heads, cache, traced_decode_attention
        )
        plan.prefill_attention, plan.choices["prefill_attention"] = choose_prefill_attention(
            held, num_heads, cache, grouped_prefill_attention
        )
    plan.lora = LoRAKernelPlan.choose(model, cache)
    if plan.lora is not None:
        plan.choices["lora_few_rows"] = {"records": list(plan.lora.records.values())}
    if weight is None:
        plan.decoder_layout = PACKED
    elif plan.gemv_sizes:
        plan.decoder_layout = ROW_MAJOR  # DecodeGemv reduces over row-major weights
    else:
        plan.choices["decoder_layout"] = fastest_one_row_layout(weight, cache)
        plan.decoder_layout = str(plan.choices["decoder_layout"]["winner"])
    if any(prepacking_runs(m.weight) for m in dense_layers(model)):
        rows = tuple(r for r in ROWS if r not in plan.gemv_sizes)
        plan.dense = DenseKernelTable(model, cache, rows, tuple(r for r in timed_rows(head_rows) if r in rows))
        plan.choices["dense_kernels"] = plan.dense.records
    if 1 not in plan.static_sizes and isinstance(model.lm_head, nn.Linear):
        plan.head_t, plan.choices["lm_head"] = one_row_head(model.lm_head.weight, cache)
    plan.head_forms = _head_forms(
        model, plan, cache=cache, activations=activations, head_rows=head_rows, second_forms=second_form_gb != 0
    )
    if plan.head_forms is not None:
        plan.choices["head_forms"] = plan.head_forms.record
    _log(plan, isinstance(model.lm_head, nn.Linear))
    return plan


def _head_forms(
    model: nn.Module,
    plan: KernelPlan,
    cache: KernelChoiceCache,
    activations: str,
    head_rows: int | None,
    second_forms: bool,
) -> HeadFormTable | None:
    """The timed second forms of a float32 head beside packed layers (a quantized checkpoint that left its head
    unquantized; a float model's head stays as loaded), None where no candidate with one is admitted here; one row
    is not timed where the head is compiled for it (static size 1)."""
    head = float_head(model)
    if head is None or plan.packed is None:
        return None
    candidates = head_candidates(head.weight, activations, second_forms, cache)
    if not any(c.second_form for c in candidates.values()):
        return None
    rows = tuple(r for r in timed_rows(head_rows) if r != 1 or 1 not in plan.static_sizes)
    return HeadFormTable(model, cache=cache, rows=rows, candidates=candidates, column_major=plan.head_t is not None)


def _log(plan: KernelPlan, linear_head: bool) -> None:
    sources = [c.get("source") for c in plan.choices.values() if "source" in c]
    if plan.packed is not None:
        sources += [r.get("source") for r in plan.packed.records.values()]
    how = "timed" if "timed" in sources else "timed earlier on this machine" if sources else "configured"
    if not linear_head:
        head = "packed"
    elif plan.head_forms is not None and plan.head_forms.winners().get(1, AS_LOADED) != AS_LOADED:
        head = f"{plan.head_forms.winners()[1]} second form"
    else:
        head = "column-major copy" if plan.head_t is not None else "compiled" if 1 in plan.static_sizes else "as loaded"
    logger.info(
        "Kernel plan (%s): static compile sizes %s (GEMV reductions for %s rows), decoder weights %s, one-row "
        "logits head %s, decode attention %s, prefill attention %s",
        how,
        list(plan.static_sizes) or "none",
        plan.gemv_sizes or "no",
        plan.decoder_layout,
        head,
        plan.decode_attention,
        plan.prefill_attention,
    )
    if plan.packed is not None:
        logger.info(
            "Packed kernels (%s activations%s): %s",
            plan.packed.activations,
            "" if plan.packed.int8_runs or plan.packed.activations == FLOAT32 else ", no int8 kernel runs here",
            "; ".join(
                f"{name}: " + ", ".join(f"{rows_label(r)} {rec['winners'][str(r)]}" for r in plan.packed.rows[name])
                for name, rec in plan.packed.records.items()
            ),
        )
