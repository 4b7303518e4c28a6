"""Benchmarks: `kiln bench` (kiln per mode and batch size beside HF transformers) and `kiln loadtest` (a
dynamic-batch load generator against a running server), with their metrics and reports."""
