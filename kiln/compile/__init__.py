"""Graph mode: trace the forward, split it at attention, compile each piece once, capture it per size.

One role per module, as vLLM's compilation package separates them (the executor that composes them is
kiln.executor.graph; the kernel choices they run with are kiln.kernels):
backend.py    trace the forward with dynamo, num_tokens symbolic      split.py     cut at the splitting ops
build.py      trace + split -> PiecewiseForward                     piece.py     one piece, three modes, hooks
compiler.py   piece compilers (inductor, eager), one registry        store.py     compiled-piece store (memo,
cache.py      the on-disk cache with manifests                                     cache, verification)
verify.py     a compiled piece checked against its graph              capture.py   CUDA-graph / CPU captures
capturer.py   capture every piece per size, largest first             dispatch.py  per step: full, pieces or dynamic
passes.py     inductor post-grad passes (DecodeGemv)                  settings.py  GraphConfig from recipe/flags
full_graph.py the full decode graph (attention traced inside)         decode_buffers.py  its persistent inputs
decode_units.py  the full decode graph cut into layer units, each distinct one compiled once
stamp.py      a uniform decoder stack traced through three layers, the rest stamped from the third
layer_signature.py  which stacks are uniform (layers that trace to the same nodes)
modes.py      piece modes and the --piece-modes syntax                counters.py  what graph mode did, as numbers
fusion_match.py, fusion_flow.py, fusion.py, fusion_check.py: recipe fusion groups found in the pieces (and in the
full decode graph's layer units), judged on the generated code, enforced after compiling (a required group not
realised fails the compile at its line).
artifacts.py, lint.py, kernels.py, diagnose.py: what `kiln compile` writes and how failures read.
"""
