"""The engine: one configuration path (args.py -> build.py), the step (core.py: schedule -> execute -> update),
the scheduler and KV block pool, the model runner, sampling, detokenization, and the offline `LLM` API."""
