"""The engine: a step is propose -> schedule -> execute -> update, over rooms by role. Arrows point down this list
only (tests/structure/test_imports.py checks it, and that no two rooms import each other):

serving/      the engine behind its callers: the server's async engine loop, the offline `LLM` API, the commands
setup/        engine options resolved into an `EngineConfig`; `build_engine`, the one way an engine is made
core.py       EngineCore: its parts built once (pool, runner, scheduler, proposer, updater), requests in, prepare
loop/         the step's verbs in order: one step at a time, or steps in flight on a pipeline
output/       the update verb: sampled tokens applied to their requests (stops, detokenization), outputs to callers
speculation/  draft tokens proposed before the step is scheduled (n-gram or a draft model), and what they earned
running/      a scheduled step turned into tensors, run by the executor, its rows sampled into new tokens
scheduling/   continuous batching in a token budget and the allowed step shapes, over the paged KV block pool
request.py    a request's life in the engine, and the plain output objects handed to callers
sampling/     per-request sampling parameters, the batched sampler, verification of draft tokens
structured/   outputs held to a JSON schema, regex, choice or grammar (llguidance), masked per step
"""
