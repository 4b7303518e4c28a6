"""Cross-section checks that need the solver: capture sizes against the num_tokens constraints, seq_len against
the KV cache and the model's context, batch size against the page pool."""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.recipe.analysis import Analysis
from kiln.recipe.constraints import CONSTRAINTS_PATH
from kiln.recipe.diagnostics import Diagnostic, Severity
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.solver import Fact
from kiln.recipe.source import SourceDoc


def check_capture_sizes(doc: SourceDoc, spec: RecipeSpec, analysis: Analysis) -> list[Diagnostic]:
    """Every capture size is a num_tokens value the constraints allow; otherwise name the constraints it breaks.
    Under graph.mode eager nothing is captured (sizes written there are refused: kiln.recipe.contract.check_inert)."""
    if spec.graph.mode == "eager":
        return []
    system, out = analysis.system, []
    for i, size in enumerate(spec.graph.capture_sizes):
        query = Fact(f"capture{i}", system.symbol("num_tokens") == size, f"num_tokens == {size}")
        outcome = system.check(extra=[query])
        path = ("graph", "capture_sizes", i)
        if outcome.status == "unsat":
            broken = [f for f in sorted(outcome.core, key=_line) if f is not query]
            message = f"capture size {size} violates {' and '.join(f.label for f in broken)}"
            if path in doc.values or not broken or broken[0].constraint is None:
                out.append(doc.diagnostic("error", message, path))
            else:  # NOTE: default sizes are written nowhere; point at the constraint they break instead.
                c = broken[0].constraint
                message = f"default {message} (graph.capture_sizes is not set: {spec.graph.capture_sizes})"
                out.append(doc.at("error", message, line=c.line, col=c.col, length=len(c.text)))
        elif outcome.status == "unknown":
            out.append(doc.diagnostic("warning", f"could not check capture size {size} ({outcome.reason})", path))
    return out


def check_kv_capacity(
    doc: SourceDoc, spec: RecipeSpec, analysis: Analysis, config: ModelConfig | None
) -> list[Diagnostic]:
    kv = spec.memory_plan.kv_cache
    capacity = kv.max_pages * kv.block_size
    pages = ("memory_plan", "kv_cache", "max_pages")
    written = f"line {doc.position(pages)[0]}" if pages in doc.values else "the default"
    where = f"max_pages {kv.max_pages} x block_size {kv.block_size}, {written}"
    out = []
    seq_len = analysis.bounds.get("seq_len")
    if seq_len is None:
        message = (
            f"seq_len has no provable upper bound, but the KV cache holds {capacity} tokens ({where}); "
            f"add a constraint such as seq_len <= {capacity}"
        )
        out.append(doc.diagnostic("error", message, CONSTRAINTS_PATH, key=True))
    elif seq_len > capacity:
        message = (
            f"seq_len can reach {seq_len} ({bounded_by(analysis, 'seq_len')}) but the KV cache "
            f"holds {capacity} tokens ({where})"
        )
        out.append(_at_bound(doc, analysis, name="seq_len", severity="error", message=message))
    elif config is not None and seq_len > config.max_position_embeddings:
        message = (
            f"seq_len can reach {seq_len} but the model was trained for {config.max_position_embeddings} "
            "positions; quality degrades beyond that"
        )
        out.append(_at_bound(doc, analysis, name="seq_len", severity="warning", message=message))
    batch = analysis.bounds.get("batch_size")
    if batch is not None and batch > kv.max_pages:
        message = (
            f"batch_size can reach {batch} but only {kv.max_pages} sequences fit in the KV cache at once "
            f"(each needs at least one page; {where})"
        )
        out.append(_at_bound(doc, analysis, name="batch_size", severity="warning", message=message))
    if analysis.bounds.get("num_tokens") is None:
        message = (
            "num_tokens has no provable upper bound; add a constraint such as num_tokens <= 2048 to size the batch"
        )
        out.append(doc.diagnostic("warning", message, CONSTRAINTS_PATH, key=True))
    return out


def _bounding_facts(analysis: Analysis, name: str) -> list[Fact]:
    """The constraints that cap `name` at its maximum: the minimal core of `name > maximum` with all of them."""
    reached = analysis.bounds.get(name)
    if reached is None:
        return []
    query = Fact(f"above:{name}", analysis.system.symbol(name) > reached, f"{name} > {reached}")
    outcome = analysis.system.check(extra=[query])
    return [f for f in sorted(outcome.core, key=_line) if f.constraint is not None] if outcome.status == "unsat" else []


def bounded_by(analysis: Analysis, name: str) -> str:
    labels = [f.label for f in _bounding_facts(analysis, name)]
    return f"bounded by {' and '.join(labels)}" if labels else "its largest allowed value"


def _at_bound(doc: SourceDoc, analysis: Analysis, name: str, severity: Severity, message: str) -> Diagnostic:
    """Place a finding on the constraint that sets the bound, or on the constraints list."""
    facts = _bounding_facts(analysis, name)
    if facts and facts[0].constraint is not None:
        c = facts[0].constraint
        return doc.at(severity, message, line=c.line, col=c.col, length=len(c.text))
    return doc.diagnostic(severity, message, CONSTRAINTS_PATH, key=True)


def _line(fact: Fact) -> int:
    return fact.constraint.line if fact.constraint else 0
