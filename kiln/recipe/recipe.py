"""`load_recipe`: parse, check the schema, prove the constraints consistent, check them against the checkpoint and
across sections. The result is a frozen Recipe the engine reads its graph settings from."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from kiln.config import LoRAConfig, SpeculativeConfig
from kiln.graph_mode import GraphMode
from kiln.model.loader import CheckpointHeader
from kiln.recipe.analysis import analyze
from kiln.recipe.capacity import check_capture_sizes, check_kv_capacity
from kiln.recipe.checkpoint import (
    check_model_constraints,
    check_weights,
    checkpoint_modules,
    model_ops,
    model_symbols,
    open_header,
)
from kiln.recipe.constraints import CONSTRAINTS_PATH, Constraint, parse_constraints
from kiln.recipe.contract import check_hardware, check_identity, check_inert, check_refused, quantization_mode
from kiln.recipe.diagnostics import Diagnostic, RecipeError, has_errors, sort_diagnostics
from kiln.recipe.guards import RecipeGuards
from kiln.recipe.lora_checks import (
    check_lora_rank,
    check_lora_slots,
    check_lora_targets,
    has_lora,
    lora_buffer_bytes,
)
from kiln.recipe.machine import this_machine
from kiln.recipe.schema import FusionGroup, RecipeSpec
from kiln.recipe.schema_check import validate_schema
from kiln.recipe.sections import (
    check_fusion_groups,
    check_graph,
    check_group_size,
    check_inputs,
    check_kv_dtype,
    check_memory,
)
from kiln.recipe.solver import DEFAULT_BUDGET_S, SolverBudget, SolverBudgetExceeded
from kiln.recipe.source import SourceDoc, parse_source
from kiln.recipe.stages import StageLayers, check_parallel, pipeline_size, stage_layers_of

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. Bounds are the largest values the constraints allow (None: unbounded)."""

    path: str
    spec: RecipeSpec
    hash: str
    constraints: list[Constraint]
    model_path: str  # absolute path of the checkpoint checked against
    model_values: dict[str, int]
    witness: dict[str, int]
    bounds: dict[str, int | None]
    diagnostics: list[Diagnostic] = field(default_factory=list)
    fusion_lines: tuple[int, ...] = ()  # the line of each fusion group, for the fusion check's messages

    @property
    def dtype(self) -> str:
        return self.spec.weights.dtype

    @property
    def device(self) -> str:
        return self.spec.hardware.device

    @property
    def quantization(self) -> str:
        """How the engine runs the weights (kiln.recipe.contract.quantization_mode)."""
        return quantization_mode(self.spec)

    @property
    def quantization_group_size(self) -> int:
        return self.spec.quantization.group_size

    @property
    def activations(self) -> str:
        """int8x2 | int8 | float32: the activations of packed products."""
        return self.spec.quantization.activations

    @property
    def second_form_memory_gb(self) -> float | None:
        """The most memory second forms of packed weights may take (None: the engine's default budget)."""
        return self.spec.memory_plan.second_form_memory_gb

    @property
    def kv_cache_dtype(self) -> str:
        return self.spec.memory_plan.kv_cache.dtype

    @property
    def block_size(self) -> int:
        return self.spec.memory_plan.kv_cache.block_size

    @property
    def max_pages(self) -> int:
        return self.spec.memory_plan.kv_cache.max_pages

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The recipe's speculative decoding (None: the recipe has no `speculative` section)."""
        if "speculative" not in self.spec.model_fields_set:
            return None
        return self.spec.speculative.config()

    @property
    def lora(self) -> LoRAConfig | None:
        """The recipe's LoRA adapters, on (None: the recipe has no `lora` section; adapters are then the flags')."""
        if "lora" not in self.spec.model_fields_set:
            return None
        lora = self.spec.lora
        modules = None if lora.target_modules is None else tuple(lora.target_modules)
        return LoRAConfig(
            enabled=True,
            max_loras=lora.max_loras,
            max_lora_rank=lora.max_rank,
            target_modules=modules,
            dtype=lora.dtype,
        )

    @property
    def prefix_caching(self) -> bool:
        return self.spec.memory_plan.kv_cache.prefix_caching

    @property
    def max_num_seqs(self) -> int | None:
        return self.bounds.get("batch_size")

    @property
    def max_num_batched_tokens(self) -> int | None:
        return self.bounds.get("num_tokens")

    @property
    def max_model_len(self) -> int | None:
        return self.bounds.get("seq_len")

    @property
    def graph_mode(self) -> GraphMode:
        """graph.mode: which graphs run (kiln.graph_mode)."""
        return GraphMode(self.spec.graph.mode)

    @property
    def splitting_ops(self) -> list[str]:
        return list(self.spec.graph.splitting_ops)

    @property
    def capture_sizes(self) -> list[int]:
        """Ascending; validation guarantees each is distinct and allowed by the num_tokens constraints."""
        return sorted(self.spec.graph.capture_sizes)

    @property
    def compile_sizes(self) -> list[int] | None:
        """Capture sizes also compiled for their static shape; None: the engine decides (see GraphConfig)."""
        sizes = self.spec.graph.compile_sizes
        return None if sizes is None else sorted(sizes)

    @property
    def compiler(self) -> str:
        return self.spec.graph.compiler

    @property
    def debug_mode(self) -> bool:
        return self.spec.debug.debug_mode

    @property
    def fusion_groups(self) -> list[FusionGroup]:
        return list(self.spec.fusion_groups)

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel ranks per pipeline stage (parallel.tensor)."""
        return self.spec.parallel.tensor

    @property
    def pipeline_parallel(self) -> int:
        """Pipeline stages: parallel.pipeline, else the number of device_affinity entries, else 1."""
        return pipeline_size(self.spec)

    @property
    def stage_layers(self) -> StageLayers | None:
        """Each pipeline stage's decoder layers (ascending), stages in device_id order; None without
        device_affinity (the engine then splits the layers evenly). Validation proved them a partition of the
        model's layers into consecutive runs in increasing order."""
        return stage_layers_of(self.spec)

    @cached_property
    def guards(self) -> RecipeGuards:
        """Run-time checks of the constraints (built once; see RecipeGuards for which call checks what)."""
        return RecipeGuards(self.path, self.constraints, self.model_values)


def load_recipe(path: str, model: str | None = None, solver_budget_s: float = DEFAULT_BUDGET_S) -> Recipe:
    """Load and validate a recipe file; `model` overrides `model.path`. Raises RecipeError listing every error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RecipeError(
            [Diagnostic(path, 0, col=0, severity="error", message=f"cannot read the recipe: {reason}")]
        ) from None
    return load_recipe_text(text, path, model, solver_budget_s)


def load_recipe_text(
    text: str, file: str = "<string>", model: str | None = None, solver_budget_s: float = DEFAULT_BUDGET_S
) -> Recipe:
    """Validate recipe text; `file` names it in diagnostics (relative model paths resolve next to it).
    `solver_budget_s` bounds all the Z3 work of this validation together."""
    doc = parse_source(text, file)
    spec, schema_diagnostics = validate_schema(doc)  # with errors, a partial spec: checked, never returned
    if spec is None:
        raise RecipeError(schema_diagnostics)
    constraints, diagnostics = parse_constraints(doc, spec.input_constraints.constraints)
    diagnostics += schema_diagnostics
    header, found = open_header(doc, spec, model)
    diagnostics += found
    values = model_symbols(header.config) if header else None
    diagnostics += check_graph(doc, spec) + check_inputs(doc, spec, values)
    diagnostics += check_fusion_groups(doc, spec, model_ops(header) if header else None)
    diagnostics += check_refused(doc, spec) + check_inert(doc, spec) + check_hardware(doc, spec, this_machine())
    broken = _sections_of(doc, schema_diagnostics)
    if not broken & {"parallel", "device_affinity"}:
        diagnostics += check_parallel(doc, spec, header.config.num_layers if header else None)
    if header is not None:
        diagnostics += check_weights(doc, spec, header) + check_model_constraints(doc, constraints, values, header)
        diagnostics += check_identity(doc, spec, header)
        if not broken & {"quantization"}:
            diagnostics += check_group_size(doc, spec, header.config)
        modules = checkpoint_modules(header)
        if not broken & {"lora"}:
            diagnostics += check_lora_targets(doc, spec, modules) + check_lora_rank(doc, spec, header.config)
        if not broken & {"memory_plan", "hardware", "weights", "quantization", "lora"}:
            lora_bytes = lora_buffer_bytes(spec, header.config, modules) if has_lora(spec) else 0
            diagnostics += check_memory(doc, spec, header.config, lora_bytes=lora_bytes)
        if not broken & {"memory_plan"}:
            diagnostics += check_kv_dtype(doc, spec, header.config)
    witness: dict[str, int] = {}
    bounds: dict[str, int | None] = {}
    if len(constraints) == len(spec.input_constraints.constraints):  # every constraint parsed
        budget = SolverBudget(solver_budget_s)
        found, witness, bounds = _prove(
            doc, spec, constraints=constraints, values=values, header=header, budget=budget, broken=broken
        )
        diagnostics += found
    diagnostics = sort_diagnostics(diagnostics)
    if has_errors(diagnostics) or header is None or values is None:
        raise RecipeError(diagnostics)
    logger.info("Recipe validated: %d constraints satisfied, 0 conflicts", len(constraints))
    model_path = os.path.abspath(header.path)
    lines = tuple(doc.position(("fusion_groups", i))[0] for i in range(len(spec.fusion_groups)))
    return Recipe(
        file,
        spec,
        hash=recipe_hash(spec, constraints),
        constraints=constraints,
        model_path=model_path,
        model_values=values,
        witness=witness,
        bounds=bounds,
        diagnostics=diagnostics,
        fusion_lines=lines,
    )


def _prove(
    doc: SourceDoc,
    spec: RecipeSpec,
    constraints: list[Constraint],
    values: dict[str, int] | None,
    header: CheckpointHeader | None,
    budget: SolverBudget,
    broken: set[str],
) -> tuple[list[Diagnostic], dict[str, int], dict[str, int | None]]:
    """The solver's findings, the witness and the bounds; running out of `budget` is an error at the constraints.
    Capture sizes and the KV capacity are checked against the bounds unless their section has schema errors."""
    try:
        analysis = analyze(doc, constraints, values, budget)
        if not analysis.satisfiable:
            return analysis.diagnostics, {}, {}
        found = list(analysis.diagnostics)
        if "graph" not in broken:
            found += check_capture_sizes(doc, spec, analysis)
        if "memory_plan" not in broken:
            found += check_kv_capacity(doc, spec, analysis, header.config if header else None)
        if "lora" not in broken:
            found += check_lora_slots(doc, spec, analysis)
    except SolverBudgetExceeded as exc:
        message = (
            f"could not finish proving the constraints: {exc}; simplify the constraints (products or divisions "
            "of two symbols are the costly ones)"
        )
        return [doc.diagnostic("error", message, CONSTRAINTS_PATH, key=True)], {}, {}
    return found, analysis.witness, analysis.bounds


def _sections_of(doc: SourceDoc, diagnostics: list[Diagnostic]) -> set[str]:
    """Top-level sections holding a diagnostic: the checks that weigh a section against others skip it, since the
    partial spec has defaults where its bad values were and a message would describe a default as written."""
    starts = sorted((line, path[0]) for path, (line, _) in doc.keys.items() if len(path) == 1)
    found = set()
    for d in diagnostics:
        owner = [name for line, name in starts if line <= d.line]
        if owner:
            found.add(str(owner[-1]))
    return found


def recipe_hash(spec: RecipeSpec, constraints: list[Constraint]) -> str:
    """sha256 of the normalised recipe: defaults filled in, keys sorted, constraints re-spelt canonically, so
    formatting, comments and key order do not matter and any changed value does."""
    data = spec.model_dump(mode="json")
    data["input_constraints"]["constraints"] = [c.expr.normalized for c in constraints]
    # NOTE: the placement as it runs (pipeline derived, stages by device_id); one device adds nothing, so recipes
    # written before `parallel` existed keep their hash (and their compile-cache entries).
    del data["parallel"], data["device_affinity"]
    if "lora" not in spec.model_fields_set:
        del data["lora"]  # NOTE: recipes without adapters keep the hash they had before the section existed
    stages = stage_layers_of(spec)
    if spec.parallel.tensor > 1 or pipeline_size(spec) > 1 or stages is not None:
        data["parallel"] = {
            "tensor": spec.parallel.tensor,
            "pipeline": pipeline_size(spec),
            "stage_layers": None if stages is None else [list(s) for s in stages],
        }
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
