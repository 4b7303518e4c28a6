"""What `kiln loadtest` reports: throughput, TTFT / TPOT / end-to-end percentiles, the prompt tokens the server
found cached and, when it speculates, its acceptance (`summarize`), as text (`format_report`) and as a plot of the
percentiles over time."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import asdict
from typing import Any

import numpy as np

from kiln.bench.loadtest import PERCENTILES, LoadTestResult


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(result: LoadTestResult) -> dict[str, Any]:
    ok = [r for r in result.records if r.ok]
    errors = Counter(r.error for r in result.records if r.error is not None)
    duration = max(result.duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    told = [r for r in ok if r.cached_tokens is not None]  # requests whose server said what it found cached
    cached_tokens = sum(r.cached_tokens or 0 for r in told)
    told_prompt_tokens = sum(r.prompt_tokens for r in told)
    cfg = asdict(result.config)
    cfg.pop("api_key")
    return {
        "config": cfg,
        "duration_s": result.duration_s,
        "num_requests": len(result.records),
        "num_completed": len(ok),
        "num_errors": sum(errors.values()),
        "errors": dict(errors.most_common(5)),
        "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": output_tokens / duration,
        "total_throughput_tok_s": (output_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_prompt_tokens": cached_tokens if told else None,
        "cached_of_prompt_tokens": told_prompt_tokens if told else None,  # of the requests that reported it
        "prefix_cache_hit_rate": cached_tokens / max(1, told_prompt_tokens) if told else None,
        "speculative_decoding": _speculation(result),
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": _stats([r.e2e for r in ok if r.e2e is not None]),
    }


SPEC_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")


def _speculation(result: LoadTestResult) -> dict[str, float] | None:
    """The server's speculative-decoding counts over the test (its /health before and after), with the mean
    acceptance length; None when the server reported none (speculation off, or not a kiln server)."""
    if result.speculation is None:
        return None
    before, after = result.speculation
    counts = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTS}
    drafts = counts["num_drafts"]
    return counts | {"mean_acceptance_length": 1 + counts["num_accepted_tokens"] / drafts if drafts else 0.0}


def format_report(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = [
        f"Requests: {summary['num_completed']}/{summary['num_requests']} completed, {summary['num_errors']} errors "
        f"in {summary['duration_s']:.2f} s",
        f"Throughput: {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput_tok_s']:.1f} output tok/s, "
        f"{summary['total_throughput_tok_s']:.1f} total tok/s",
        f"{'latency (ms)':<14}{'mean':>10}" + "".join(f"{'P' + str(p):>10}" for p in PERCENTILES),
    ]
    if summary["prefix_cache_hit_rate"] is None:
        lines.append("Prefix cache: the server did not report cached prompt tokens")
    else:
        lines.append(
            f"Prefix cache: {summary['cached_prompt_tokens']} of {summary['cached_of_prompt_tokens']} prompt tokens "
            f"cached ({summary['prefix_cache_hit_rate']:.1%})"
        )
    if (spec := summary["speculative_decoding"]) is not None:
        accepted, proposed = spec["num_accepted_tokens"], spec["num_draft_tokens"]
        lines.append(
            f"Speculative decoding: {accepted} of {proposed} draft tokens accepted ({accepted / max(1, proposed):.1%})"
            f" in {spec['num_drafts']} verifications, mean acceptance length {spec['mean_acceptance_length']:.2f}"
        )
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        s = summary[key]
        lines.append(f"{label:<14}{ms(s['mean']):>10}" + "".join(f"{ms(s[f'p{p}']):>10}" for p in PERCENTILES))
    for message, count in summary["errors"].items():
        lines.append(f"error x{count}: {message}")
    return "\n".join(lines)


def plot_latency_over_time(result: LoadTestResult, path: str) -> None:
    """P50/P90/P99 of TTFT, TPOT and E2E per time window (by completion time), one panel each."""
    # NOTE: matplotlib is an optional dependency (the dev extra), needed only with --plot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((r for r in result.records if r.ok), key=lambda r: r.start + (r.e2e or 0.0))
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    num_windows = max(1, min(20, len(ok) // 3))
    end = max((r.start + (r.e2e or 0.0) for r in ok), default=1.0)
    edges = np.linspace(0.0, end, num_windows + 1)
    for ax, key, label in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT (s)", "TPOT (s)", "end-to-end (s)"), strict=True):
        done = [(r.start + (r.e2e or 0.0), getattr(r, key)) for r in ok if getattr(r, key) is not None]
        ax.scatter([t for t, _ in done], [v for _, v in done], s=6, color="0.7", label="requests")
        for p in PERCENTILES:
            xs, ys = [], []
            for lo, hi in itertools.pairwise(edges):
                window = [v for t, v in done if lo <= t <= hi]
                if window:
                    xs.append((lo + hi) / 2)
                    ys.append(float(np.percentile(window, p)))
            ax.plot(xs, ys, marker="o", label=f"P{p}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("time since start (s), by request completion")
    cfg = result.config
    fig.suptitle(
        f"kiln loadtest: {len(ok)} requests, concurrency {cfg.concurrency}, "
        f"input {cfg.input_len[0]}:{cfg.input_len[1]}, output {cfg.output_len[0]}:{cfg.output_len[1]}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
