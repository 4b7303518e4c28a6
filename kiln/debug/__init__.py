"""The graph-mode debugger: each classic failure of graph mode as one command (`kiln debug ...`).

taps.py           boundary values (embed, per-layer attn/mlp, norm, logits) from eager hooks and from piece outputs
session.py        a model, engines that run it on each path (eager, eager-fp64, traced, compiled, captured) through
                  EngineCore, taps installed through the graph executor's hooks; optionally teacher-forced so paths
                  see the same tokens
runs.py           one debug request through an engine: fit checks, teacher forcing, speculation's forced drafts,
                  a cached prefix primed first (`--cached-prefix`)
diff.py           per-boundary metrics against a float64 noise floor; the first divergence
bisect.py         the minimal set of pieces whose mode causes a failure, about log2(N) rounds per piece found; a final
                  compiled round tells a miscompile from a capture/replay fault
cases.py          saved inputs, expectations and thresholds (safetensors + JSON), replayed as regression checks
case_adapter.py   the LoRA adapter a case was saved with (name, directory, rank, files' SHA-256), checked at replay
faults.py         injected faults (a miscompiled layer, a stale capture input) that prove the debugger right
trace.py          trace mode (KILN_DEBUG=1 / recipe debug_mode): every piece launch logged, replay inputs checked
explain.py        graph breaks and trace failures with module path, op, source line and a hint
ranks.py          `kiln debug diff` and `kiln debug bisect` on a multi-device engine: every rank debugs its own shard
cli.py            parsers of `kiln debug diff | bisect | save-case | check-case | explain`
commands.py       their handlers: open a session from the engine flags, run, report
pytest_plugin.py  collects saved cases as pytest tests: every `case.json` becomes one test
"""
