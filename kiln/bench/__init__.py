"""Benchmarks: `kiln bench` (kiln per mode and batch size beside HF transformers, llama.cpp and vLLM, with kiln's
batch-1 memory roofline) and `kiln loadtest` (a dynamic-batch load generator against a running server), with their
metrics and reports.

anchors.py          the systems `kiln bench --compare` runs beside kiln: a base class and one registry entry per system
cli.py              the `kiln bench` parser (handler in commands.py)
commands.py         handlers of `kiln bench` and `kiln loadtest`
hf_runner.py        the HF transformers anchor: `model.generate` in static batches on the same checkpoint and prompts
kiln_runner.py      kiln's side of the benchmark: closed-loop runs of the engine at a fixed concurrency
llamacpp_runner.py  the llama.cpp anchor (llama-cpp-python) on the same GGUF file, prompts and thread count as kiln
loadtest.py         `kiln loadtest`: a dynamic-batch serving load test (random lengths, Poisson arrivals, a shared
                    prefix, multi-turn chats)
loadtest_client.py  one load-test request over HTTP: a streamed completion or chat turn timed into its record
loadtest_report.py  what `kiln loadtest` reports: throughput, latency percentiles, cached prompt tokens; text and plot
metrics.py          what one benchmark run measured (timings per request) and the rates and ratios derived from it
modes.py            the execution modes a bench compares: the engine flags of each
report.py           the side-by-side tables printed by `kiln bench`
roofline.py         batch-1 decode against the memory roofline: weight bytes per step, measured read bandwidth
vllm_runner.py      the vLLM anchor (vLLM's CPU build, its own environment) on the same weights in bf16, kiln's closed
                    loop, in a child process
vllm_worker.py      that child: run by vLLM's Python, imports nothing of kiln
"""
