"""Handlers of `kiln generate` and `kiln chat` (an `LLM` built from the engine flags, prompts in, text out) and of
`kiln compile` (graph mode built once through `build_engine`, every artifact written to --out)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.engine.sampling.sampling_params import SamplingParams
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import KilnError
from kiln.log import setup_logging
from kiln.model.paths import resolve_model_path

if TYPE_CHECKING:
    from kiln.engine.serving.llm import LLM

# NOTE: the engine (torch, inductor: ~7 s to import on a 2-core EPYC) is imported once the flags, the sampling
# parameters and the model's path have been checked, so a bad flag or a missing model is reported in a fraction of
# a second (issue 52: the suite runs such commands as a user does).


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags of `add_sampling_args`; requests draw their seeds from the engine's `--seed`."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
    )


def make_llm(args: argparse.Namespace) -> LLM:
    config = resolve_engine_config(EngineArgs.from_cli_args(args))
    resolve_model_path(config.model)  # a missing model is reported before the engine loads
    from kiln.engine.serving.llm import LLM

    return LLM(config=config)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    with make_llm(args) as llm:
        prompts = args.prompt
        if args.chat:
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        outputs = llm.generate(prompts, params)
    failed = 0
    for user_prompt, out in zip(args.prompt, outputs, strict=True):
        if args.json:
            record = {
                "prompt": user_prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "num_prompt_tokens": out.num_prompt_tokens,
                "num_output_tokens": len(out.token_ids),
            }
            if out.error:
                record["error"] = out.error
            print(json.dumps(record), flush=True)
        elif out.error:
            print(f"kiln: error: {out.error}", file=sys.stderr)
        else:
            print(out.text, flush=True)
        failed += out.error is not None
    return 1 if failed else 0


def cmd_chat(args: argparse.Namespace) -> int:
    with make_llm(args) as llm:
        return _chat(llm, args)


def _chat(llm: LLM, args: argparse.Namespace) -> int:
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kiln chat: type a message, /reset to clear the history, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.encode_chat(history)
        reply = ""
        try:
            for out in llm.stream(prompt, params):
                print(out.delta, end="", flush=True)
                reply = out.text
        except KilnError as exc:
            history.pop()
            print(f"kiln: error: {exc}", file=sys.stderr)
            continue
        print(flush=True)
        history.append({"role": "assistant", "content": reply})


def cmd_compile(args: argparse.Namespace) -> int:
    setup_logging()
    out = Path(args.out)
    config = resolve_engine_config(EngineArgs.from_cli_args(args, dump_dir=str(out)))
    if not config.graph_mode.is_graph:
        raise KilnError("kiln compile builds graph mode: give a graph mode other than eager (or none: the default)")
    from kiln.compile.artifacts import write_trace_failure
    from kiln.compile.diagnose import GraphTraceError
    from kiln.engine.setup.build import build_engine
    from kiln.executor.graph import GraphExecutor

    try:
        engine = build_engine(config)
    except GraphTraceError as exc:
        write_trace_failure(exc, out)
        print(f"kiln: wrote the graph-break report to {out / 'lint.txt'}", file=sys.stderr)
        raise
    graph = engine.executor
    assert isinstance(graph, GraphExecutor)
    summary = {
        "out": str(out),
        "pieces": len(graph.pieces),
        "build_s": round(graph.build_seconds, 2),
        "counters": graph.counters.as_dict(),
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
    }
    print(json.dumps(summary, indent=1))
    return 0
