"""The engine: one configuration path (args.py -> build.py), the step (core.py: schedule -> execute -> update),
the scheduler and KV block pool, the model runner, sampling, detokenization, and the offline `LLM` API.

arg_types.py        argparse value types every subcommand shares, and the flag each `EngineArgs` field gets
admission.py        a client's prompt and parameters checked and turned into a `Request` (never touching state)
args.py             `EngineArgs`: every engine option in one dataclass; generates the CLI flags and the `EngineConfig`
async_engine.py     the engine loop for serving: one thread owns the EngineCore; asyncio callers get per-request queues
block_group.py      one KV block pool and its layers: a request's blocks grown, trimmed (rejected drafts), released
build.py            `build_engine(config)`, the one way an engine is made, and `EXECUTORS`, the executor registry
cli.py              parsers of `kiln generate`, `kiln chat` and `kiln compile` (handlers in commands.py)
commands.py         handlers of `kiln generate`, `kiln chat` and `kiln compile`
core.py             EngineCore: the step (schedule -> execute -> update), failure isolation, the prepare phase
detokenizer.py      incremental detokenization with stop strings
grammar_build.py    a constraint's llguidance grammar, compiled and tried on its first tokens (short errors, no panics)
grammar_cache.py    compiled grammars bounded in bytes, and failed constraints remembered by key
inert_options.py    options given that would do nothing in the resolved config, refused with the flag named and why
kv_cache.py         paged KV cache bookkeeping: a pool of fixed-size blocks with a free list and reference counts
kv_plan.py          how many KV blocks an engine allocates, and the start-up lines that say so
kv_window.py        sliding-window KV blocks: which leading blocks of a sequence no future query reads
llm.py              the offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`
ngram.py            the n-gram proposer's index: where each n-gram of a sequence last ended (prompt lookup)
model_runner.py     a SchedulerOutput turned into tensors, the executor run under a forward context, sampling
outputs.py          the stop rules, and the `RequestOutput` handed to callers
prefill_budget.py   prefill chunks budgeted by cost (attention grows with the context) and by measured step time
prefix_cache.py     the keys of cached KV blocks (chained hashes over tokens and a root), and the cache's stats
prefix_sharing.py   automatic prefix caching: a waiting request's longest cached prefix, sibling copies, registering
prompt_logprobs.py  prompt logprobs scored from a prefill chunk's rows (fp32 log-softmax, rank, top-k), per position
pooling.py          embeddings: a prefill chunk's rows pooled (last, mean, cls), the vector normalized
rank_role.py        `RankRole`: a rank's part in each step of a multi-device engine, fixed at construction
recipe_config.py    the recipe's overlay on the engine config: where recipe values override flags, each logged
request.py          a request's life in the engine, and the plain output objects handed to callers
request_stream.py   what the async engine hands asyncio callers: `RequestStream`, the table delivering outputs, stats
sampler.py          batched sampling: grammar masks, penalties, temperature, top-k, top-p, min-p, generators, logprobs
sampling_params.py  per-request sampling parameters, validated on construction with errors naming the field
scheduler.py        continuous batching with a token budget, chunked prefill and preemption by recompute
scheduler_output.py `SchedulerOutput`: what the scheduler hands the runner each step (plain dataclasses)
spec_verify.py      speculative decoding's verification: greedy acceptance and rejection sampling of draft tokens
speculation.py      speculative decoding's proposals: which drafts a step verifies, per-request back-off, the counters
draft.py            speculative decoding's draft model: a second engine proposing drafts, one round per step
step_pipeline.py    steps in flight on a pipeline: rank 0 launches the next step while later stages run the last one
step_plan.py        a step's inputs as plain lists (what rank 0 sends the other ranks), and their micro-batch split
step_sample.py      a step's sampled rows turned into each sequence's new tokens (`ModelRunnerOutput`)
step_shape.py       the shape of each step under a recipe's step constraints (padding tokens and sequences)
structured_output.py  outputs held to a JSON schema, regex, choice or grammar (llguidance), masked per step
updater.py          the update verb: a step's sampled tokens applied to its requests (stops, grammars, drafts, outputs)
"""
