"""Parser of `kiln bench` (handler in kiln.bench.commands): offline throughput/latency per execution mode and
batch size, optionally beside HF transformers and llama.cpp."""

from __future__ import annotations

import argparse

from kiln.bench.modes import MODE_ARGS
from kiln.engine.setup.arg_types import int_at_least
from kiln.engine.setup.args import EngineArgs
from kiln.graph_mode import DEFAULT_GRAPH_MODE

POSITIVE = int_at_least(1)

# The systems --compare runs (kiln.bench.anchors.ANCHORS), named here so that `kiln --help` loads no torch.
ANCHOR_NAMES = ("hf", "llama.cpp", "vllm")


def add_bench_subcommand(subparsers: argparse._SubParsersAction) -> None:
    b = subparsers.add_parser(
        "bench", help="offline throughput/latency benchmark (optionally vs HF, llama.cpp and vLLM)"
    )
    EngineArgs.add_cli_args(b)
    b.add_argument("--num-requests", type=POSITIVE, default=32, help="requests per batch size")
    b.add_argument("--num-requests-bs1", type=POSITIVE, default=4, help="requests at batch size 1")
    b.add_argument("--input-len", type=POSITIVE, default=128, help="prompt tokens (random ids)")
    b.add_argument("--output-len", type=POSITIVE, default=128, help="output tokens per request (>= 2)")
    b.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="P",
        help="every prompt starts with the same P random tokens before its own --input-len (a shared system "
        "prompt: measures prefix caching; compare with --no-enable-prefix-caching)",
    )
    b.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32], help="concurrency levels, e.g. 1,8,32")
    b.add_argument(
        "--modes", type=_mode_list, default=[DEFAULT_GRAPH_MODE.value], help=f"comma list of {', '.join(MODE_ARGS)}"
    )
    b.add_argument(
        "--compare",
        type=_anchor_list,
        action="extend",
        default=[],
        metavar="SYSTEMS",
        help="also run, on the same model and prompts (a comma list, or the flag repeated): hf (transformers "
        "generate), llama.cpp (llama-cpp-python on the .gguf file; `make llamacpp` installs it), vllm (vLLM's CPU "
        "build on the same weights in bf16, in its own environment; `make vllm` creates it)",
    )
    b.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    b.set_defaults(handler="kiln.bench.commands:cmd_bench")


def _int_list(text: str) -> list[int]:
    return [POSITIVE(t) for t in text.split(",") if t.strip()]


def _mode_list(text: str) -> list[str]:
    modes = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [m for m in modes if m not in MODE_ARGS]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}: expected a comma list of {', '.join(MODE_ARGS)}")
    return modes


def _anchor_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in ANCHOR_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown system(s) {unknown}: expected a comma list of {', '.join(ANCHOR_NAMES)}"
        )
    return names
