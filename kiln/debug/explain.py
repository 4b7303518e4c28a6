"""`kiln debug explain`: every graph break and trace failure of a model, with where, what, and what to do.

Graph mode needs the whole forward as one graph. `torch._dynamo.explain` traces past graph breaks and lists them;
an op dynamo cannot run at all (e.g. a custom op without a fake implementation) stops the trace, and is reported
as a trace failure. Each finding names the module path (found by replaying the forward eagerly, see
kiln/compile/diagnose.py), the op, the source line and a concrete hint.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kiln.compile.backend import padding_context, trace_forward
from kiln.compile.diagnose import GraphTraceError, explain_graph_break, explain_trace_failure
from kiln.compile.split import split_graph
from kiln.model.forward_context import set_forward_context

SAMPLE_TOKENS = 8

_HINTS = (
    (
        ("fake impl", "fake tensor", "no fake"),
        "register a fake (meta) implementation for it: `@{op}.register_fake` returning an empty tensor of the "
        "output's shape and dtype (e.g. torch.empty_like(x)), so dynamo can trace shapes through it",
    ),
    (
        ("builtin", "marked as skipped", "c/c++"),
        "move the call out of forward(), or wrap it in a torch.library.custom_op with a register_fake "
        "implementation so the graph keeps it as one opaque node",
    ),
    (
        ("data-dependent", "data dependent", ".item()", "tensor.item", "generic_jump"),
        "a Python branch on a tensor's value: do not read tensor values on the host inside forward (`.item()`, "
        "`if tensor:`); keep shapes and control flow static (torch.where, torch._check), or compute the value in "
        "the runner and pass it in",
    ),
)
_DEFAULT_HINT = (
    "make it traceable: a torch.library.custom_op with a register_fake implementation, or "
    "torch.compiler.allow_in_graph for a function dynamo can trace"
)


@dataclass
class Finding:
    kind: str  # "graph break" | "trace failure"
    module_path: str
    op: str
    location: str
    reason: str
    hint: str

    def format(self) -> str:
        where = self.module_path or "the model's top-level forward"
        why = self.reason if len(self.reason) <= 300 else self.reason[:300] + " ..."
        return f"{self.kind} in {where}\n  op: {self.op}\n  at: {self.location}\n  why: {why}\n  hint: {self.hint}"


def hint_for(op: str, reason: str) -> str:
    text = reason.lower()
    for needles, hint in _HINTS:
        if any(n in text for n in needles):
            return hint.format(op=op.rsplit(".", 1)[-1])
    return _DEFAULT_HINT


def _finding(kind: str, err: GraphTraceError) -> Finding:
    return Finding(
        kind,
        module_path=err.module_path,
        op=err.op,
        location=err.location,
        reason=err.reason,
        hint=hint_for(err.op, err.reason),
    )


@dataclass
class Explanation:
    findings: list[Finding]
    num_pieces: int | None  # pieces after the split at attention, when the forward traced as one graph

    def format(self) -> str:
        if not self.findings:
            return (
                f"No graph breaks or trace failures: the forward traces as one graph and splits into "
                f"{self.num_pieces} pieces at the attention op."
            )
        lines = [f"{len(self.findings)} problem(s) keep the forward from tracing as one graph:"]
        lines += [f"{i}. {f.format()}" for i, f in enumerate(self.findings, 1)]
        return "\n".join(lines)


@contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Dynamo logs and warns about every break it meets; the findings report them, once and with module paths."""
    dynamo_logger = logging.getLogger("torch._dynamo")
    level = dynamo_logger.level
    dynamo_logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        dynamo_logger.setLevel(level)


def explain_model(model: nn.Module, kv_caches: list[torch.Tensor], splitting_ops: tuple[str, ...]) -> Explanation:
    device = next(model.parameters()).device
    ctx = padding_context(SAMPLE_TOKENS, kv_caches, device)
    input_ids = torch.zeros(SAMPLE_TOKENS, dtype=torch.long, device=device)
    positions = torch.zeros(SAMPLE_TOKENS, dtype=torch.long, device=device)

    def run_eager() -> None:
        with torch.inference_mode(), set_forward_context(ctx):
            model(input_ids, positions)

    findings: list[Finding] = []
    failure: GraphTraceError | None = None
    result = None
    torch._dynamo.reset()
    # NOTE: maybe_mark_dynamic: after a break the resumed frames may specialise num_tokens; that is not an error here
    torch._dynamo.maybe_mark_dynamic(input_ids, 0)
    torch._dynamo.maybe_mark_dynamic(positions, 0)
    with torch.inference_mode(), set_forward_context(ctx), _quiet_dynamo():
        try:
            result = torch._dynamo.explain(model)(input_ids, positions)
        except torch._dynamo.exc.TorchDynamoException as exc:
            failure = explain_trace_failure(exc, model, run_eager)
        if failure is not None:
            # NOTE: a hard failure aborts explain; run it again with errors suppressed (the failing frame runs
            # eagerly) to list the graph breaks around it as well.
            torch._dynamo.reset()
            with torch._dynamo.config.patch(suppress_errors=True):
                result = torch._dynamo.explain(model)(input_ids, positions)
    for br in result.break_reasons if result is not None else []:
        frame = br.user_stack[-1] if br.user_stack else None
        if frame is None:
            continue
        err = explain_graph_break(
            br.reason,
            frame.filename,
            lineno=frame.lineno or 0,
            source_line=frame.line,
            model=model,
            run_eager=run_eager,
        )
        if failure is None or err.location != failure.location:
            findings.append(_finding("graph break", err))
    if failure is not None:
        findings.append(_finding("trace failure", failure))
    torch._dynamo.reset()
    if findings:
        return Explanation(findings, None)
    try:
        traced = trace_forward(model, model, kv_caches=kv_caches, device=device, sample_size=SAMPLE_TOKENS)
    except GraphTraceError as err:
        return Explanation([_finding("trace failure", err)], None)
    num_pieces = len(split_graph(traced.gm, splitting_ops).pieces)
    return Explanation([], num_pieces)
