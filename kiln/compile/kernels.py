"""Read the kernels out of a compiled piece's generated wrapper code (inductor's `def call(args)`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_CALL = re.compile(
    r"^\s*(?:\w+\s*=\s*)?(?P<name>(?:cpp_fused|triton_)\w*|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?"
    r"|torch\.ops\.\w+\.\w+(?:\.\w+)?)(?:\.run)?\("
)


@dataclass
class Kernel:
    name: str  # cpp_fused_mul_silu_1 | extern_kernels.mm | torch.ops.kiln.attention.default
    is_extern: bool  # a library call (BLAS matmul, aten fallback) rather than generated code

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
    kernels = []
    for line in body.splitlines()[1:]:
        match = _CALL.match(line)
        if match:
            name = match.group("name")
            kernels.append(Kernel(name, not name.startswith(("cpp_fused", "triton_"))))
    return kernels
