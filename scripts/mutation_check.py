"""A mutation check of kiln's critical code: one-line mutants (a wrong constant, a dropped condition) applied one at a
time to a copy of the repository, each run against the tests that claim to catch it. A mutant the tests pass is a
*survivor*: a property the suite says it checks and does not. Run before a release and record the result in
docs/mutation_check.md; not part of `make test` (each mutant reruns its tests: minutes).

Each mutant names one file, a text that occurs there exactly once and what it becomes, and the pytest arguments
that must fail under it. Exit status: 0 when every mutant is killed, 1 when one survives, 2 when one is broken (its
text not found once, or its tests end in an error other than failures).

Usage: python scripts/mutation_check.py [--only NAME ...] [--list] [--markdown FILE] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("kiln", "tests", "examples", "recipes", "pyproject.toml")
PYTEST_FAILED = 1  # pytest's exit status when tests ran and some failed


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest arguments: the tests that must fail
    why: str  # the property the tests claim


MUTANTS = (
    Mutant(
        name="rope-theta-x1.001",
        path="kiln/model/layers.py",
        old="inv_freq = 1.0 / (config.rope_theta ** (",
        new="inv_freq = 1.0 / ((config.rope_theta * 1.001) ** (",
        tests=("tests/engine/test_parity_hf.py", "-k", "600_token"),
        why="rotary tables as HF's at every position of a long prompt",
    ),
    Mutant(
        name="debugger-threshold-x1e5",
        path="kiln/debug/diff.py",
        old="NOISE_RATIO = 100.0",
        new="NOISE_RATIO = 100.0 * 1e5",
        tests=("tests/debug/test_diff_bisect.py", "-k", "small_fault"),
        why="the debugger finds faults of 1e-3 to 1e-5 in their layer and piece",
    ),
    Mutant(
        name="structured-sample-first-for-top-k-top-p",
        path="kiln/engine/running/step_sample.py",
        old="return p.is_greedy or (p.top_k in (0, -1) and p.top_p == 1.0 and p.min_p == 0.0)",
        new="return True",
        tests=("tests/engine/test_structured_output.py", "-k", "top_k_and_top_p"),
        why="top-k and top-p rows under a grammar sample the masked distribution",
    ),
    Mutant(
        name="grammar-mask-skipped-for-mixed-batches",
        path="kiln/engine/sampling/sampler.py",
        old="        logits[index] = logits[index] + mask",
        new="        logits[index] = logits[index]",
        tests=("tests/engine/test_structured_output.py", "-k", "masks_constrained"),
        why="a constrained row among free rows is masked",
    ),
    Mutant(
        name="top-p-keeps-the-token-that-reaches-it",
        path="kiln/engine/sampling/sampler.py",
        old="    drop = before >= top_p\n",
        new="    drop = before > top_p\n",
        tests=("tests/engine/test_sampler.py", "tests/engine/test_sampler_batched.py"),
        why="top-p drops a token once the mass before it reaches top_p (vLLM's rule)",
    ),
    Mutant(
        name="sliding-window-one-too-wide",
        path="kiln/model/attention.py",
        old="mask &= cols > rows - window",
        new="mask &= cols >= rows - window",
        tests=("tests/model/test_sliding_window.py",),
        why="a sliding-window layer sees exactly `window` keys",
    ),
    Mutant(
        name="prefix-cache-trusts-a-key",
        path="kiln/engine/scheduling/kv_cache.py",
        old="if entry is None or entry.tokens != toks or entry.parent != parent:",
        new="if entry is None or entry.parent != parent:",
        tests=("tests/engine/test_prefix_blocks.py",),
        why="a cached block is shared only when its tokens match (colliding keys never share)",
    ),
    Mutant(
        name="tiled-dequant-blas-off",
        path="kiln/kernels/torch_kernels.py",
        old="            outs.append(nn.functional.linear(x, weight))",
        new="            outs.append(nn.functional.linear(x, weight) * 1.01)",
        tests=("tests/quant/test_packed.py", "-k", "every_kernel_candidate"),
        why="every kernel candidate matches its reference, whether or not it wins here",
    ),
    Mutant(
        name="send-buffer-not-fixed",
        path="kiln/server/connections.py",
        old="            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)",
        new="            pass",
        tests=("tests/server/test_connections.py", "-k", "holds_back"),
        why="a client that stops reading holds the sender back within a fixed buffer",
    ),
    Mutant(
        name="message-markup-not-counted",
        path="kiln/server/limits.py",
        old="MESSAGE_MARKUP_CHARS = 32",
        new="MESSAGE_MARKUP_CHARS = 0",
        tests=("tests/server/test_limits_and_auth.py", "-k", "many_empty_messages"),
        why="empty messages count their template markup against --max-prompt-chars",
    ),
)


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    verdict: str  # killed | survived | broken
    seconds: float
    detail: str


def run_mutant(mutant: Mutant, timeout_s: float) -> Outcome:
    """Apply `mutant` to a fresh copy of the repository and run its tests there."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kiln-mutant-") as tmp:
        copy = Path(tmp)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, copy / name)
        target = copy / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            return Outcome(mutant, "broken", 0.0, f"{mutant.old!r} occurs {text.count(mutant.old)} times")
        target.write_text(text.replace(mutant.old, mutant.new))
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests]
        env = {**os.environ, "PYTHONPATH": str(copy)}
        try:
            run = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome(mutant, "broken", time.monotonic() - started, f"tests ran past {timeout_s:g} s")
    seconds = time.monotonic() - started
    summary = next((line for line in reversed(run.stdout.splitlines()) if line.strip()), "")
    if run.returncode == PYTEST_FAILED:
        return Outcome(mutant, "killed", seconds, summary)
    if run.returncode == 0:
        return Outcome(mutant, "survived", seconds, summary)
    return Outcome(mutant, "broken", seconds, f"pytest exit {run.returncode}: {summary}")


def markdown(outcomes: list[Outcome]) -> str:
    lines = [
        "| mutant | file | property the tests claim | verdict | seconds | tests |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        m = o.mutant
        tests = " ".join(m.tests)
        lines.append(f"| `{m.name}` | `{m.path}` | {m.why} | **{o.verdict}** | {o.seconds:.0f} | `{tests}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, help="run only these mutants (by name)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--markdown", default=None, help="also write the result table to this file")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one mutant's tests")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no mutant named {', '.join(sorted(unknown))}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:45} {m.path}: {m.why}")
        return 0
    outcomes = []
    for m in chosen:
        outcome = run_mutant(m, args.timeout)
        outcomes.append(outcome)
        print(f"{outcome.verdict:9} {m.name:45} {outcome.seconds:6.0f} s  {outcome.detail}", flush=True)
    table = markdown(outcomes)
    if args.markdown:
        Path(args.markdown).write_text(table)
    killed = sum(o.verdict == "killed" for o in outcomes)
    print(f"{killed} of {len(outcomes)} mutants killed")
    if any(o.verdict == "broken" for o in outcomes):
        return 2
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
