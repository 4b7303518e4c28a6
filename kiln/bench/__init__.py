"""Benchmarks: `kiln bench` (kiln per mode and batch size beside HF transformers and llama.cpp, with kiln's batch-1
memory roofline) and `kiln loadtest` (a dynamic-batch load generator against a running server), with their metrics
and reports."""
