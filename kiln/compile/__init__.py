"""Graph mode: trace the forward, split it at attention, compile each piece once, capture it per size.

Entry points: `graph_config_from` (recipe/CLI -> GraphConfig), `enable_graph_mode` (wire a GraphRunner
into a ModelRunner), `GraphRunner` (the forward replacement), `CompileCounters`.
"""

from kiln.compile.counters import CompileCounters
from kiln.compile.settings import graph_config_from

__all__ = ["CompileCounters", "graph_config_from"]
