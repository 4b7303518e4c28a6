"""Running: a scheduled step turned into tensors, run by the executor under a forward context, and its rows
sampled into each sequence's new tokens (prompt logprobs and pooled embeddings from the same rows).

kv_plan.py          how many KV blocks an engine allocates, and the start-up lines that say so
model_runner.py     a SchedulerOutput turned into tensors, the executor run under a forward context, sampling
pooling.py          embeddings: a prefill chunk's rows pooled (last, mean, cls), the vector normalized
prompt_logprobs.py  prompt logprobs scored from a prefill chunk's rows (fp32 log-softmax, rank, top-k), per position
rank_role.py        `RankRole`: a rank's part in each step of a multi-device engine, fixed at construction
step_plan.py        a step's inputs as plain lists (what rank 0 sends the other ranks), and their micro-batch split
step_sample.py      a step's sampled rows turned into each sequence's new tokens (`ModelRunnerOutput`)
"""
