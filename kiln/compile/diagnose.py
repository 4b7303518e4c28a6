"""Turn a dynamo trace failure into an error that names the module path, the op and the source line.

Dynamo reports the failing user frames (file, line) but not which module instance was running: every
`model.layers.N.mlp` shares one `forward`. We replay the forward eagerly once with module hooks keeping a
stack of module paths and a profile hook that stops at the first call made from the failing line.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch import nn

from kiln.errors import KilnError


class GraphTraceError(KilnError):
    """The forward could not be captured as one graph: names where and what, and what to do."""

    def __init__(self, module_path: str, op: str, location: str, reason: str) -> None:
        where = module_path or "the model's top-level forward"
        super().__init__(
            f"graph trace failed in {where} at op {op} ({location}): {reason}. "
            "Graph mode traces the whole forward: make the op traceable (a torch.library custom op with a "
            "register_fake impl, or torch.compiler.allow_in_graph), or run without graph mode"
        )
        self.module_path = module_path
        self.op = op
        self.location = location
        self.reason = reason


def explain_trace_failure(exc: BaseException, model: nn.Module, run_eager: Callable[[], Any]) -> GraphTraceError:
    frames = list(getattr(exc, "real_stack", None) or [])
    if not frames:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return GraphTraceError("", _op_name(exc, None), "unknown location", _reason(exc))
    inner = frames[-1]
    location = f"{inner.filename}:{inner.lineno}: {(inner.line or '').strip()}"
    module_path = _module_at_line(model, inner.filename, inner.lineno, run_eager)
    return GraphTraceError(module_path, _op_name(exc, inner.line), location, _reason(exc))


def explain_graph_break(
    reason: str, filename: str, lineno: int, source_line: str | None, model: nn.Module, run_eager: Callable[[], Any]
) -> GraphTraceError:
    """The same diagnosis for a graph break `torch._dynamo.explain` reported (a reason and a user frame)."""
    text = RuntimeError(reason)
    location = f"{filename}:{lineno}: {(source_line or '').strip()}"
    module_path = _module_at_line(model, filename, lineno, run_eager)
    return GraphTraceError(module_path, _op_name(text, source_line), location, _reason(text))


def _reason(exc: BaseException) -> str:
    text = str(exc)
    match = re.search(r"Explanation:\s*(.+)", text)
    line = match.group(1) if match else text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line.strip().rstrip(".")


def _op_name(exc: BaseException, source_line: str | None) -> str:
    text = str(exc)
    skipped = re.search(r"module:\s*([\w.]+),\s*qualname:\s*([\w.]+)", text)
    if skipped:
        return f"{skipped.group(1)}.{skipped.group(2)}"
    node = re.search(r"call_function\s+([\w.:]+)\(", text)
    if node:
        return node.group(1)
    builtin = re.search(r"trace the builtin `([\w.]+?)\.?`", text)
    if builtin:
        return builtin.group(1)
    no_fake = re.search(r"fake impl registered for <CustomOpDef\(([\w:]+)\)>", text)
    if no_fake:
        return no_fake.group(1).replace("::", ".")
    return (source_line or "").strip() or type(exc).__name__


def _module_at_line(model: nn.Module, filename: str, lineno: int, run_eager: Callable[[], Any]) -> str:
    stack: list[str] = []
    found: list[str] = []
    handles = []

    def enter(path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            stack.append(path)

        return hook

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(leave))

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if found:
            return
        caller = frame if event == "c_call" else frame.f_back
        if event in ("call", "c_call") and caller is not None:
            code = caller.f_code
            if caller.f_lineno == lineno and code.co_filename == filename and stack:
                found.append(stack[-1])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run_eager()
    except Exception as eager_exc:  # reported in the path; the trace error is raised
        if not found:
            return f"an unknown module (the eager forward failed too: {type(eager_exc).__name__}: {eager_exc})"
    finally:
        sys.setprofile(previous)
        for h in handles:
            h.remove()
    return _qualify(model, found[0]) if found else ""


def _qualify(model: nn.Module, path: str) -> str:
    module = model.get_submodule(path) if path else model
    return f"{path or '<root>'} ({type(module).__name__})"
