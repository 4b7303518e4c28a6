"""kiln: an LLM inference engine with piecewise graph mode as the first-class path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutput", "__version__"]

if TYPE_CHECKING:
    from kiln.engine.request import RequestOutput
    from kiln.engine.sampling.sampling_params import SamplingParams
    from kiln.engine.serving.llm import LLM
    from kiln.engine.structured.constraint import StructuredOutput
    from kiln.lora.request import LoRARequest

_LAZY = {
    "LLM": "kiln.engine.serving.llm",
    "LoRARequest": "kiln.lora.request",
    "RequestOutput": "kiln.engine.request",
    "SamplingParams": "kiln.engine.sampling.sampling_params",
    "StructuredOutput": "kiln.engine.structured.constraint",
}


def __getattr__(name: str) -> Any:
    """Import the public API on first use, so `kiln --help` and light submodules do not load torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
