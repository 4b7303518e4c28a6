"""Scheduling and KV: which sequences run each step and with how many tokens, within a token budget, the allowed
step shapes and the paged KV block pool (prefix caching, sliding windows). Plain data in and out: no model runs
here and no tensor is touched (admission only seeds a request's generator).

admission.py         a client's prompt and parameters checked and turned into a `Request` (never touching state)
block_group.py       one KV block pool and its layers: a request's blocks grown, trimmed (rejected drafts), released
kv_cache.py          paged KV cache bookkeeping: a pool of fixed-size blocks with a free list and reference counts
kv_window.py         sliding-window KV blocks: which leading blocks of a sequence no future query reads
prefill_budget.py    prefill chunks budgeted by cost (attention grows with the context) and by measured step time
prefix_cache.py      the keys of cached KV blocks (chained hashes over tokens and a root), and the cache's stats
prefix_sharing.py    automatic prefix caching: a waiting request's longest cached prefix, sibling copies, registering
scheduler.py         continuous batching with a token budget, chunked prefill and preemption by recompute
scheduler_output.py  `SchedulerOutput`: what the scheduler hands the runner each step (plain dataclasses)
step_shape.py        the shape of each step under a recipe's step constraints (padding tokens and sequences)
"""
