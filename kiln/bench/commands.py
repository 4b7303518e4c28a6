"""Handlers of `kiln bench` and `kiln loadtest`.

The bench: each mode's engine (built from the engine flags) run closed-loop per batch size, the machine's read
bandwidth measured once for kiln's batch-1 roofline, then every --compare system (kiln.bench.anchors) on the same
model and prompts; a report with ratios, optionally as JSON. The random prompts are seeded by the engine's --seed.
The load test: kiln.bench.loadtest against a running server, reported by loadtest_report."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kiln.bench.anchors import ANCHORS, AnchorSetup
from kiln.bench.kiln_runner import run_kiln, warm_up_kiln
from kiln.bench.loadtest import LoadTestConfig, parse_range, run_loadtest
from kiln.bench.loadtest_report import format_report, plot_latency_over_time, summarize
from kiln.bench.metrics import RunResult, compute_ratios, random_prompts
from kiln.bench.modes import engine_args_for_mode
from kiln.bench.report import print_report
from kiln.bench.roofline import Roofline, read_bandwidth_gbs
from kiln.config import EngineConfig
from kiln.engine.serving.llm import LLM
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError, KilnError
from kiln.model.loader import open_checkpoint

logger = logging.getLogger("kiln")


def _mode_config(args: argparse.Namespace, mode: str) -> EngineConfig:
    # NOTE: the graph options act in the graph modes: an eager mode beside them is not refused for them
    checked = mode != "eager" or all(m == "eager" for m in args.modes)
    return resolve_engine_config(engine_args_for_mode(args, mode), refuse_inert_options=checked)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.output_len < 2:
        raise ConfigError(f"--output-len {args.output_len}: need >= 2 tokens to measure time per output token")
    anchors = {name: ANCHORS[name] for name in args.compare}
    results: list[RunResult] = []
    prompts: list[list[int]] = []
    batches: dict[int, list[list[int]]] = {}
    roofline: Roofline | None = None
    model_path = ""
    device = "cpu"
    configs = {mode: _mode_config(args, mode) for mode in args.modes}
    if anchors:  # every anchor's own checks before any engine is built (a missing anchor fails in a second)
        model_path = open_checkpoint(configs[args.modes[0]].model).path
        for anchor in anchors.values():
            anchor.check(model_path)
    for mode, config in configs.items():
        llm = LLM(config=config)
        model_path = llm.engine.checkpoint_path
        device = str(next(llm.engine.model.parameters()).device)
        if not prompts:
            vocab = llm.engine.model_config.vocab_size
            prompts = random_prompts(args.num_requests, args.input_len, vocab, _prompt_seed(args))
            if args.shared_prefix_len > 0:
                prefix = random_prompts(1, args.shared_prefix_len, vocab, _prompt_seed(args) + 1)[0]
                prompts = [prefix + p for p in prompts]
            batches = {bs: prompts[: _num_requests(args, bs)] for bs in args.batch_sizes}
        warm_up_kiln(llm, prompts[0])
        for bs, batch in batches.items():
            results.append(run_kiln(llm=llm, mode=mode, prompts=batch, output_len=args.output_len, batch_size=bs))
        if roofline is None:
            # NOTE: measured after the engine has set torch's thread count, with the thread count kiln ran with.
            plan = llm.engine.executor.plan
            head_form = None if plan.head_forms is None else plan.head_forms.one_row_bytes()
            replaced = {} if head_form is None else {plan.head_forms.weight.data_ptr(): head_form}
            roofline = Roofline.measure(
                llm.engine.model, model_path, read_bandwidth_gbs(), plan.second_form_bytes, replaced=replaced
            )
        del llm
        gc.collect()
    assert roofline is not None  # the parser gives at least one mode
    for r in results:
        if r.system == "kiln" and r.batch_size == 1:
            r.roofline_efficiency = roofline.efficiency(r.mean_tpot_s)
    setup = AnchorSetup(
        model_path=model_path,
        dtype=args.dtype,
        device=device,
        num_threads=torch.get_num_threads(),
        batches=batches,
        output_len=args.output_len,
    )
    for anchor in anchors.values():
        results += anchor.run(setup)
    _count_hf_matches(results)
    ratios = compute_ratios(results)
    print_report(results, ratios, roofline=roofline)
    if args.json:
        report = {
            "config": _config(args, model_path),
            "roofline": roofline.to_dict(),
            "results": [r.to_row() for r in results],
            "ratios": ratios,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        logger.info("Wrote %s", args.json)
    return 0


def _count_hf_matches(results: list[RunResult]) -> None:
    """Per kiln run, how many requests' greedy tokens equal HF's at the same batch size."""
    hf_runs = {r.batch_size: r for r in results if r.system == "hf"}
    for r in results:
        hf = hf_runs.get(r.batch_size)
        if r.system == "kiln" and hf is not None:
            r.hf_match = sum(a == b for a, b in zip(r.token_ids, hf.token_ids, strict=True))


def _prompt_seed(args: argparse.Namespace) -> int:
    """The random prompts are the same from run to run unless --seed picks others."""
    return args.seed if args.seed is not None else 0


def _num_requests(args: argparse.Namespace, batch_size: int) -> int:
    return min(args.num_requests_bs1, args.num_requests) if batch_size == 1 else args.num_requests


def _config(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    return {
        "model": model_path,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "num_requests_bs1": min(args.num_requests_bs1, args.num_requests),
        "input_len": args.input_len,
        "shared_prefix_len": args.shared_prefix_len,
        "enable_prefix_caching": args.enable_prefix_caching,
        "output_len": args.output_len,
        "batch_sizes": args.batch_sizes,
        "modes": args.modes,
        "compare": list(dict.fromkeys(args.compare)),
        "seed": _prompt_seed(args),
        "num_threads": torch.get_num_threads(),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "torch": torch.__version__,
    }


def run_loadtest_command(args: argparse.Namespace) -> int:
    """Exit 0 when at least one request completed, 1 when none did (errors are in the report either way)."""
    try:
        cfg = LoadTestConfig(
            url=args.url,
            concurrency=args.concurrency,
            num_requests=args.num_requests,
            input_len=parse_range(args.input_len, "--input-len"),
            output_len=parse_range(args.output_len, "--output-len"),
            model=args.model,
            api_key=args.api_key,
            request_rate=args.request_rate,
            timeout=args.timeout,
            seed=args.seed,
            shared_prefix_len=args.shared_prefix_len,
            turns=args.turns,
        )
        result = asyncio.run(run_loadtest(cfg))
    except KilnError as exc:
        print(f"kiln loadtest: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    summary = summarize(result)
    print(format_report(summary))
    if args.json:
        report = {**summary, "requests": [asdict(r) for r in result.records]}
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"Wrote {args.json}")
    if args.plot:
        plot_latency_over_time(result, args.plot)
        print(f"Wrote {args.plot}")
    return 0 if summary["num_completed"] else 1
