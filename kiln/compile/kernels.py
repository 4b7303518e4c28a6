"""Read the kernels out of a compiled piece's generated wrapper code (inductor's `def call(args)`).

Each launch records the storages it reads and writes, so a caller can follow data from kernel to kernel. Graph
inputs are `arg{i}_1` (the i-th placeholder of the compiled graph), buffers `buf{n}`; a view or a reuse of a
buffer (`reinterpret_tensor(buf0, ...)`, `buf6 = buf5  # reuse`) is the storage it came from. Which arguments a
generated kernel writes is read from its definition: inductor names its pointers `in_ptr*`, `out_ptr*` and
`in_out_ptr*`, in C++ and Triton alike. An extern call writes its `out=` argument or the name it is assigned to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CALL = re.compile(
    r"^\s*(?:(?P<result>\w+)\s*=\s*)?(?P<name>(?:cpp_fused|triton_)\w*|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?"
    r"|torch\.ops\.\w+\.\w+(?:\.\w+)?)(?:\.run)?\((?P<args>.*)\)\s*$"
)
_VIEW = re.compile(r"^\s*(?P<name>buf\d+)\s*=\s*(?:reinterpret_tensor\()?(?P<source>buf\d+|arg\d+_\d+)\b")
_TENSOR = re.compile(r"\b(?:buf\d+|arg\d+_\d+)\b")


@dataclass
class Kernel:
    name: str  # cpp_fused_mul_silu_1 | extern_kernels.mm | torch.ops.kiln.attention.default
    is_extern: bool  # a library call (BLAS matmul, aten fallback) rather than generated code
    reads: tuple[str, ...] = ()  # storages it reads: `arg3_1` (graph input 3) or `buf0`
    writes: tuple[str, ...] = ()

    @property
    def fused_ops(self) -> list[str]:
        """Op names a generated kernel is named after (`cpp_fused_mul_silu_1` -> [mul, silu])."""
        if self.is_extern:
            return [self.name.split(".")[-1]]
        parts = re.sub(r"^(cpp_fused|triton_\w+?_fused)_?", "", self.name).split("_")
        return [p for p in parts if p and not p.isdigit()]


def kernels_in(source: str) -> list[Kernel]:
    """Kernel launches of the wrapper's `call`, in order."""
    start = source.find("def call(")
    if start < 0:
        return []
    body = source[start:]
    end = body.find("\n\n\n")
    if end > 0:
        body = body[:end]
    storage: dict[str, str] = {}
    kernels = []
    for line in body.splitlines()[1:]:
        view = _VIEW.match(line)
        if view:
            storage[view["name"]] = storage.get(view["source"], view["source"])
            continue
        match = _CALL.match(line)
        if match is None:
            continue
        name = match["name"]
        is_extern = not name.startswith(("cpp_fused", "triton_"))
        reads, writes = _roles(source, name, is_extern, _split_args(match["args"]))
        if match["result"]:
            storage.pop(match["result"], None)
            writes.append(match["result"])
        kernels.append(
            Kernel(
                name,
                is_extern,
                tuple(dict.fromkeys(storage.get(s, s) for s in reads)),
                tuple(dict.fromkeys(storage.get(s, s) for s in writes)),
            )
        )
    return kernels


def _roles(source: str, name: str, is_extern: bool, args: list[str]) -> tuple[list[str], list[str]]:
    """(tensors read, tensors written) by a launch with these argument expressions."""
    reads: list[str] = []
    writes: list[str] = []
    params = [] if is_extern else _parameters(source, name)
    for i, arg in enumerate(args):
        tensors = _TENSOR.findall(arg)[:1]
        keyword, _, _ = arg.partition("=")
        if is_extern:
            (writes if keyword.strip() == "out" else reads).extend(tensors)
            continue
        param = params[i] if i < len(params) else "in_out_ptr"  # no definition: assume both
        if param.startswith(("in_ptr", "in_out_ptr")):
            reads.extend(tensors)
        if param.startswith(("out_ptr", "in_out_ptr")):
            writes.extend(tensors)
    return reads, writes


def _parameters(source: str, name: str) -> list[str]:
    """The pointer parameters of a generated kernel's definition in order (`in_ptr0`, `out_ptr0`, "" for others)."""
    start = re.search(rf"^{re.escape(name)} = async_compile\.", source, re.M)
    if start is None:
        return []
    signature = re.compile(rf"(?:\bdef {re.escape(name)}|\bkernel)\s*\(([^)]*)\)")
    found = signature.search(source, start.end())
    if found is None:
        return []
    names = []
    for param in found.group(1).split(","):
        pointer = re.search(r"\b(?:in_out_ptr|in_ptr|out_ptr)\d+\b", param)
        names.append(pointer.group(0) if pointer else "")  # "": a size or a constant
    return names


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of a call (nested calls and tuples stay whole)."""
    args, depth, current = [], 0, []
    for char in text:
        if char == "," and depth == 0:
            args.append("".join(current).strip())
            current = []
            continue
        depth += (char in "([{") - (char in ")]}")
        current.append(char)
    if "".join(current).strip():
        args.append("".join(current).strip())
    return args
