"""A batch-1 decode step (one row) against a speculative verification step (one sequence with k drafts: k + 1 rows)
of the default model in graph mode, side by side in one process: two engines, each with one teacher-forced request
(its drafts are its given tokens, so every step of the speculating engine verifies exactly k), stepped in turns,
medians of --rounds rounds of --steps steps. Wall-clock and process CPU time per step are both printed: on a shared
machine, CPU time with KILN_NUM_THREADS=1 moves least with the other work.

    KILN_NUM_THREADS=1 .venv/bin/python scripts/verify_step_bench.py [--context 128] [--steps 20] [--rounds 7] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kiln import LLM, SamplingParams


def prefill(llm: LLM, name: str, context: int, forced: list[int]) -> None:
    params = SamplingParams(max_tokens=len(forced), temperature=0, ignore_eos=True)
    llm.engine.add_request(name, [100 + i % 50 for i in range(context)], params, forced)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.requests.values()):
        llm.engine.step()
    for _ in range(5):  # warm
        llm.engine.step()


def time_steps(llm: LLM, steps: int) -> tuple[float, float]:
    """ms per step: wall clock, process CPU time."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        llm.engine.step()
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--k", type=int, default=4, help="drafts verified a step")
    args = parser.parse_args()
    common = {"graph_mode": "full_and_piecewise", "capture_sizes": [1], "max_num_seqs": 1}
    engines = {
        "1 row": LLM(**common),
        f"{args.k + 1} rows": LLM(
            **common, speculative_method="ngram", num_speculative_tokens=args.k, speculative_policy="always"
        ),
    }
    forced = [200 + (i * 7) % 1000 for i in range(args.steps * (args.rounds + 3) * (args.k + 1) + 50)]
    for name, llm in engines.items():
        prefill(llm, name, args.context, forced)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(args.rounds):  # in turns, so drift on a shared machine hits both sides alike
        for name, llm in engines.items():
            times[name].append(time_steps(llm, args.steps))
    one, many = times
    for clock, i in (("wall", 0), ("cpu", 1)):
        medians = {name: statistics.median(t[i] for t in runs) for name, runs in times.items()}
        runs = "; ".join(f"{name} {[round(t[i], 1) for t in times[name]]}" for name in engines)
        print(
            f"{clock}: {one} {medians[one]:.2f} ms, {many} {medians[many]:.2f} ms a step, "
            f"{medians[many] / medians[one]:.2f}x ({runs})",
            flush=True,
        )


if __name__ == "__main__":
    main()
