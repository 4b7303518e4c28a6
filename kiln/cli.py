"""The `kiln` command: generate, chat, bench, recipe, serve, compile, debug."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from kiln.errors import ConfigError, KilnError

Handler = Callable[[argparse.Namespace], int]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model."""
    p.add_argument("--model", default="default", help="a .gguf file, an HF directory, or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: 1 GB worth)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--recipe", default=None, help="recipe YAML: validated, then its settings and guards apply")
    g = p.add_argument_group("graph mode")
    g.add_argument("--enable-piecewise-graph", action="store_true", help="split at attention, compile, capture")
    g.add_argument("--full-graph", action="store_true", help="the whole forward as one graph (decode batches)")
    g.add_argument("--compiler", choices=["inductor", "eager"], default=None, help="piece compiler (default inductor)")
    g.add_argument("--capture-sizes", default=None, help="num_tokens sizes to capture, e.g. 1,2,4,8,16,32")
    g.add_argument(
        "--compile-sizes",
        default=None,
        help="capture sizes also compiled for their static shape, e.g. 1,2, or none (default: CPU 1,2; GPU none)",
    )
    g.add_argument("--piece-modes", default=None, help="per-piece modes, e.g. 0-3:captured,4:eager,5:compiled")
    g.add_argument("--cache-dir", default=None, help="compile cache (default ~/.cache/kiln or KILN_CACHE_DIR)")
    g.add_argument("--dump-dir", default=None, help="write graph artifacts (pieces, graph.dot, lint, profile) here")


def parse_sizes(flag: str, text: str | None) -> tuple[int, ...] | None:
    """`1,2,4` -> (1, 2, 4); `none` -> (); not given -> None."""
    if text is None or text == "":
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers or none") from None


def make_llm(args: argparse.Namespace, **overrides: object):
    """The LLM the engine flags describe; `overrides` (LLM keyword arguments) win over the flags."""
    from kiln.engine.llm import LLM

    kwargs = dict(
        enable_piecewise_graph=args.enable_piecewise_graph,
        full_graph=args.full_graph,
        compiler=args.compiler,
        capture_sizes=parse_sizes("--capture-sizes", args.capture_sizes),
        compile_sizes=parse_sizes("--compile-sizes", args.compile_sizes),
        piece_modes=args.piece_modes,
        cache_dir=args.cache_dir,
        dump_dir=args.dump_dir,
    )
    kwargs.update(overrides)
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        recipe=args.recipe,
        **kwargs,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from kiln.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = make_llm(args)
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
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
    params = sampling_params(args)
    llm = make_llm(args)
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
        prompt = llm.tokenizer.apply_chat_template(history)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming tokens")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat)

    for register in _subcommand_registrars():
        register(sub)
    return parser


def _subcommand_registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands that live with their subsystem (each module adds its own parser)."""
    from kiln.bench.cli import add_bench_subcommand
    from kiln.compile.cli import add_compile_subcommand
    from kiln.debug.cli import add_debug_subcommand
    from kiln.recipe.cli import add_recipe_subcommand
    from kiln.server.cli import add_loadtest_subcommand, add_serve_subcommand

    return [
        add_serve_subcommand,
        add_bench_subcommand,
        add_loadtest_subcommand,
        add_recipe_subcommand,
        add_compile_subcommand,
        add_debug_subcommand,
    ]


def run_command(handler: Handler, args: argparse.Namespace) -> int:
    """Run a command handler: a KilnError becomes one line on stderr and exit 1, never a traceback."""
    try:
        return handler(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
