"""Compare a path under test with a reference, boundary by boundary, against a measured noise floor.

Per boundary (all rows of the prefill and every decode step together): max abs diff and where it is, max rel diff
(|x - y| / |y|, with |y| floored at 1e-3 of the boundary's largest magnitude), SGLang's
rel_diff = 1 - 2·Σxy / Σ(x² + y²) (0 when equal, scale-free) and cosine similarity.

The *noise floor* of a boundary is the rel_diff between the reference path in the model's dtype and the same
path in float64: what rounding alone does there, which grows with depth. A boundary *diverges* when its rel_diff
exceeds max(ratio × noise floor, floor); the *first divergence* is the first diverging boundary in model order.
Accumulated drift stays under a threshold that grows with it; a bad layer jumps above its own.
Both paths see the same tokens: the path under test is teacher-forced to the reference's greedy tokens, and the
report says at which step its own greedy choice first differs, next to the reference's top-2 logit gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kiln.debug.session import EAGER, EAGER_FP64, DebugSession, PathRun
from kiln.debug.taps import LOGITS, Boundary

NOISE_RATIO = 100.0  # threshold = ratio x noise floor (rel_diff is quadratic: 10x in error magnitude)
NOISE_FLOOR = 1e-12  # smallest threshold: rel_diff of a ~1e-6 relative error


@dataclass
class TensorDiff:
    max_abs: float
    max_rel: float
    rel_diff: float
    cosine: float
    argmax: tuple[int, ...]  # index of the largest abs diff (row, then the rest of the shape)


def tensor_diff(test: torch.Tensor, ref: torch.Tensor) -> TensorDiff:
    if test.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(test.shape)} vs reference {tuple(ref.shape)}")
    x, y = test.double(), ref.double()
    diff = (x - y).abs()
    flat = int(diff.argmax()) if diff.numel() else 0
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.numel() else ()
    scale = y.abs()
    floor = max(float(scale.max()) if scale.numel() else 0.0, 1e-30) * 1e-3
    denom = float((x * x + y * y).sum())
    rel_diff = 0.0 if denom == 0.0 else max(0.0, 1.0 - 2.0 * float((x * y).sum()) / denom)
    norms = float(x.norm() * y.norm())
    cosine = 1.0 if norms == 0.0 else float((x * y).sum()) / norms
    return TensorDiff(
        max_abs=float(diff.max()) if diff.numel() else 0.0,
        max_rel=float((diff / scale.clamp_min(floor)).max()) if diff.numel() else 0.0,
        rel_diff=rel_diff,
        cosine=cosine,
        argmax=index,
    )


@dataclass
class Reference:
    """What the path under test is held to: inputs, the reference's values, and per-boundary thresholds."""

    prompt: list[int]
    num_decode: int
    tokens: list[int]  # the reference's greedy tokens (the path under test is fed these)
    step_rows: list[int]
    boundaries: dict[str, torch.Tensor]  # name -> [rows, ...] over all steps
    noise: dict[str, float]  # name -> rel_diff of the reference against float64
    thresholds: dict[str, float]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # logits rows per step (none given: one each)

    @property
    def logits(self) -> torch.Tensor:
        return self.boundaries[LOGITS]


def build_reference(
    session: DebugSession,
    prompt: Sequence[int],
    num_decode: int,
    path: str = EAGER,
    ratio: float = NOISE_RATIO,
    floor: float = NOISE_FLOOR,
) -> Reference:
    """Run the reference path, then its float64 twin on the same tokens for the noise floor."""
    ref = session.run(path, prompt, num_decode)
    exact = session.run(EAGER_FP64, prompt, num_decode, forced=ref.tokens)
    noise = {b.name: tensor_diff(ref.boundary(b.name), exact.boundary(b.name)).rel_diff for b in session.boundaries}
    return Reference(
        prompt=list(prompt),
        num_decode=num_decode,
        tokens=ref.tokens,
        step_rows=ref.step_rows,
        boundaries={b.name: ref.boundary(b.name) for b in session.boundaries},
        noise=noise,
        thresholds={name: max(ratio * value, floor) for name, value in noise.items()},
        input_ids=ref.input_ids,
        positions=ref.positions,
        logit_rows=ref.logit_rows,
    )


@dataclass
class BoundaryReport:
    name: str
    module: str
    piece: int | None
    max_abs: float
    max_rel: float
    rel_diff: float
    cosine: float
    noise: float
    threshold: float
    diverged: bool
    max_at: dict[str, int]  # step, token (row within the step), index (flat index within the row)


@dataclass
class DiffReport:
    modes: list[str]
    boundaries: list[BoundaryReport]
    first_divergence: BoundaryReport | None
    reference_tokens: list[int]
    test_tokens: list[int]
    first_token_mismatch: int | None  # first step whose greedy token differs
    top2_gaps: list[float]  # the reference's top-1 minus top-2 logit at every step
    faults: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["first_divergence"] = asdict(self.first_divergence) if self.first_divergence else None
        return out


def compare(reference: Reference, run: PathRun, boundaries: Sequence[Boundary], modes: Sequence[str]) -> DiffReport:
    """Hold `run` (teacher-forced to the reference tokens) to `reference`, boundary by boundary in model order."""
    if run.input_ids and reference.input_ids and run.input_ids != reference.input_ids:
        raise ValueError("the run was fed other tokens than the reference: teacher forcing is broken")
    reports = []
    for b in boundaries:
        ref = reference.boundaries[b.name]
        d = tensor_diff(run.boundary(b.name), ref)
        threshold = reference.thresholds[b.name]
        row = d.argmax[0] if d.argmax else 0
        rows = (reference.logit_rows or [1] * len(reference.step_rows)) if b.name == LOGITS else reference.step_rows
        step, token = _locate_row(rows, row)
        flat = 0
        for size, i in zip(ref.shape[1:], d.argmax[1:], strict=True):
            flat = flat * int(size) + i
        reports.append(
            BoundaryReport(
                name=b.name,
                module=b.module_path,
                piece=b.piece,
                max_abs=d.max_abs,
                max_rel=d.max_rel,
                rel_diff=d.rel_diff,
                cosine=d.cosine,
                noise=reference.noise[b.name],
                threshold=threshold,
                diverged=d.rel_diff > threshold,
                max_at={"step": step, "token": token, "index": flat},
            )
        )
    first = next((r for r in reports if r.diverged), None)
    mismatch = next((i for i, (a, b) in enumerate(zip(reference.tokens, run.tokens, strict=True)) if a != b), None)
    top2 = torch.topk(reference.logits.double(), 2, dim=-1).values
    return DiffReport(
        modes=list(modes),
        boundaries=reports,
        first_divergence=first,
        reference_tokens=list(reference.tokens),
        test_tokens=list(run.tokens),
        first_token_mismatch=mismatch,
        top2_gaps=[float(g) for g in top2[:, 0] - top2[:, 1]],
    )


def _locate_row(step_rows: Sequence[int], row: int) -> tuple[int, int]:
    start = 0
    for step, rows in enumerate(step_rows):
        if row < start + rows:
            return step, row - start
        start += rows
    return len(step_rows) - 1, row - start


def format_report(report: DiffReport) -> str:
    ref_mode, test_mode = report.modes
    lines = [f"kiln debug diff: {test_mode} vs {ref_mode} reference (threshold = max({NOISE_RATIO:g} x noise, floor))"]
    lines += [f"  injected fault {f}" for f in report.faults]
    header = (
        f"{'boundary':<16} {'piece':>5} {'max_abs':>10} {'max_rel':>10} {'rel_diff':>10} {'cosine':>10} "
        f"{'noise':>10} {'threshold':>10}  max at (step,token,index)"
    )
    lines.append(header)
    for r in report.boundaries:
        piece = "-" if r.piece is None else str(r.piece)
        at = r.max_at
        mark = "  <-- DIVERGED" if r.diverged else ""
        lines.append(
            f"{r.name:<16} {piece:>5} {r.max_abs:>10.3g} {r.max_rel:>10.3g} {r.rel_diff:>10.3g} {r.cosine:>10.7f} "
            f"{r.noise:>10.3g} {r.threshold:>10.3g}  ({at['step']},{at['token']},{at['index']}){mark}"
        )
    first = report.first_divergence
    if first is None:
        lines.append("First divergence: none (every boundary within its noise threshold)")
    else:
        lines.append(
            f"First divergence: {first.name} ({first.module}, piece {first.piece}): rel_diff {first.rel_diff:.3g} > "
            f"threshold {first.threshold:.3g} (noise {first.noise:.3g}), max abs {first.max_abs:.3g} at "
            f"step {first.max_at['step']} token {first.max_at['token']}"
        )
    gaps = " ".join(f"{g:.3g}" for g in report.top2_gaps)
    lines.append(f"Reference top-2 logit gap per generated token: {gaps}")
    if report.first_token_mismatch is None:
        lines.append(f"Greedy tokens agree at all {len(report.reference_tokens)} steps")
    else:
        i = report.first_token_mismatch
        lines.append(
            f"Greedy tokens first differ at step {i}: reference {report.reference_tokens[i]}, "
            f"{test_mode} {report.test_tokens[i]} (reference top-2 gap {report.top2_gaps[i]:.3g})"
        )
    return "\n".join(lines)


def run_diff(
    session: DebugSession,
    reference: Reference,
    test_mode: str,
    ref_mode: str = EAGER,
    piece_modes: dict | None = None,
) -> DiffReport:
    """Run `test_mode` teacher-forced to the reference and compare."""
    run = session.run(
        test_mode, reference.prompt, num_decode=reference.num_decode, forced=reference.tokens, piece_modes=piece_modes
    )
    report = compare(reference, run, session.boundaries, [ref_mode, test_mode])
    report.faults = list(session.fault_descriptions)
    return report
