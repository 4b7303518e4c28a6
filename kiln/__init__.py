"""kiln: an LLM inference engine with piecewise graph mode as the first-class path."""

from kiln.engine.llm import LLM
from kiln.engine.request import RequestOutput
from kiln.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
