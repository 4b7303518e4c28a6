"""Executors: how one step's forward runs (eager, or graph mode in `kiln.compile.executor`).

base.py      the `Executor` interface the model runner calls
eager.py     `EagerExecutor`: the model's own forward, with the weight layout and logits head timed fastest here
layout.py    decoder weight layouts (row- or column-major) and the one-row logits head copy
counters.py  `CompileCounters`: what graph mode did, as numbers tests assert (all zero in eager)
"""
