"""Executors: how one step's forward runs, eager or graph mode, each owning its kernel plan and counters.

base.py      the `Executor` interface the model runner calls
eager.py     `EagerExecutor`: the model's own forward, with the kernel plan timed fastest here (kiln.kernels)
graph.py     `GraphExecutor`: graph mode's roles (kiln.compile) behind the same interface, built for one GraphMode
controls.py  `GraphControls`: the debugger's controls over a built GraphExecutor (modes, rewrites, hooks, tracing)
"""
