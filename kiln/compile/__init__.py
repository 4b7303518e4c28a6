"""Graph mode: trace the forward, split it at attention, compile each piece once, capture it per size.

One role per module, as vLLM's compilation package separates them:
backend.py    trace the forward with dynamo, num_tokens symbolic      split.py     cut at the splitting ops
build.py      trace + split -> PiecewiseGraph                         piece.py     one piece, three modes, hooks
compiler.py   piece compilers (inductor, eager), one registry        store.py     compiled-piece store (memo,
cache.py      the on-disk cache with manifests                                     cache, verification)
verify.py     a compiled piece checked against its graph              capture.py   CUDA-graph / CPU captures
capturer.py   capture every piece per size, largest first             dispatch.py  replay or run dynamically
passes.py     inductor post-grad passes (DecodeGemv)                  logits_head.py  compiled one-row head
executor.py   GraphExecutor: the roles behind the Executor interface  settings.py  GraphConfig from recipe/flags
fusion_match.py, fusion_flow.py, fusion.py, fusion_check.py: recipe fusion groups found in the pieces, judged
on the generated code, enforced after compiling (a required group not realised fails the compile at its line).
packed_kernels.py: the kernel table of packed products (kiln.quant), timed per shape and row count on this machine.
artifacts.py, lint.py, kernels.py, diagnose.py: what `kiln compile` writes and how failures read.
"""
