"""`kiln debug diff | bisect | save-case | check-case | explain`: one command per classic graph-mode failure.

- accuracy drift: `diff` (which boundary first leaves the noise floor), `bisect` (which pieces' mode causes it)
- capture failure: `bisect` tells a capture/replay fault from a miscompile; KILN_DEBUG=1 checks replay addresses
- compile failure: `explain` (graph breaks and trace failures with module path, op, source line and a hint)
- regressions: `save-case` / `check-case` (exit 1 naming the boundary); cases run under pytest too
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.debug.cases import Case
    from kiln.debug.diff import Reference
    from kiln.debug.session import DebugSession, SessionOptions

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_NUM_DECODE = 4


def add_debug_subcommand(sub: argparse._SubParsersAction) -> None:
    from kiln.cli import add_engine_args

    debug = sub.add_parser("debug", help="graph-mode debugger: diff, bisect, save-case, check-case, explain")
    cmds = debug.add_subparsers(dest="debug_command", required=True)

    d = cmds.add_parser("diff", help="eager vs graph mode per boundary; reports the first divergence")
    add_engine_args(d)
    _add_run_args(d)
    d.add_argument("--case", default=None, help="take inputs, reference and thresholds from a saved debug case")
    d.add_argument(
        "--modes",
        default="eager,captured",
        help="REFERENCE,TEST paths: eager (the model), traced (pieces eager), compiled, captured",
    )
    d.set_defaults(func=cmd_diff)

    b = cmds.add_parser("bisect", help="find the minimal set of pieces whose graph mode causes a failure")
    add_engine_args(b)
    _add_run_args(b)
    how = b.add_mutually_exclusive_group()
    how.add_argument("--case", default=None, help="the failure: this debug case regresses")
    how.add_argument(
        "--check", default=None, help="the failure: CMD exits non-zero ({piece_modes} in CMD is substituted)"
    )
    b.set_defaults(func=cmd_bisect)

    s = cmds.add_parser("save-case", help="save inputs, expected outputs and per-boundary thresholds as a case")
    add_engine_args(s)
    _add_run_args(s)
    s.add_argument("--out", required=True, help="directory to write case.json and tensors.safetensors into")
    s.add_argument("--mode", default="captured", help="the path the case tests (compiled, captured)")
    s.set_defaults(func=cmd_save_case)

    c = cmds.add_parser("check-case", help="replay a debug case; exit 1 naming the first regressed boundary")
    add_engine_args(c)
    c.add_argument("case_dir", help="a directory written by `kiln debug save-case`")
    c.add_argument("--mode", default=None, help="path to test (default: the case's)")
    c.add_argument("--inject-fault", action="append", default=[], help="layer=K:mlp | piece=K:stale-input")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=cmd_check_case, model=None, dtype=None, device=None)

    e = cmds.add_parser("explain", help="list graph breaks and trace failures with module path, op and a hint")
    add_engine_args(e)
    e.set_defaults(func=cmd_explain)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    p.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 1,2,3 (models without a tokenizer)")
    p.add_argument("--num-decode", type=int, default=DEFAULT_NUM_DECODE, help="decode steps after the prefill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inject-fault", action="append", default=[], help="layer=K:mlp | piece=K:stale-input")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _options(args: argparse.Namespace, case: Case | None = None) -> SessionOptions:
    """Session options from the flags; with a case, the case's own settings where no flag overrides them."""
    from kiln.cli import parse_sizes
    from kiln.debug.session import SessionOptions

    flags = {
        "model": args.model,
        "recipe": args.recipe,
        "dtype": args.dtype,
        "compiler": args.compiler,
        "capture_sizes": parse_sizes("--capture-sizes", args.capture_sizes),
        "cache_dir": args.cache_dir,
        "num_threads": args.num_threads,
    }
    if case is not None:
        if flags["model"] == "default":
            flags["model"] = None  # add_engine_args' default: the case names its model
        return case.session_options(**flags)
    extra = {"device": args.device, "block_size": args.block_size, "seed": getattr(args, "seed", 0)}
    return SessionOptions(**{k: v for k, v in {**flags, **extra}.items() if v is not None})


def _open(args: argparse.Namespace, case: Case | None = None) -> DebugSession:
    from kiln.debug.faults import inject, parse_fault
    from kiln.debug.session import DebugSession
    from kiln.log import setup_logging

    setup_logging()
    faults = [parse_fault(spec) for spec in args.inject_fault]
    session = DebugSession.open(_options(args, case))
    if case is not None:
        _check_case_matches(case, session)
    for fault in faults:
        print(f"Injected fault {inject(session, fault)}", file=sys.stderr)
    return session


def _prompt(session: DebugSession, args: argparse.Namespace) -> list[int]:
    import torch

    from kiln.errors import ConfigError

    if args.prompt_ids:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    if session.tokenizer is not None:
        return session.tokenizer.encode(args.prompt or DEFAULT_PROMPT)
    if args.prompt:
        raise ConfigError(f"--model {args.model} has no tokenizer: give the prompt as --prompt-ids")
    vocab = session.model.config.vocab_size
    return torch.randint(0, vocab, (7,), generator=torch.Generator().manual_seed(args.seed)).tolist()


def _reference(session: DebugSession, args: argparse.Namespace, ref_mode: str = "eager") -> Reference:
    from kiln.debug.diff import build_reference

    return build_reference(session, _prompt(session, args), args.num_decode, ref_mode)


def _check_case_matches(case: Case, session: DebugSession) -> None:
    from kiln.debug.cases import check_names, fingerprint_changes

    check_names(case, session)
    for change in fingerprint_changes(case, session):
        print(f"Note: environment differs from when the case was saved: {change}", file=sys.stderr)


def _piece_modes(args: argparse.Namespace) -> dict:
    from kiln.compile.modes import parse_piece_modes

    return parse_piece_modes(args.piece_modes) if args.piece_modes else {}


def cmd_diff(args: argparse.Namespace) -> int:
    from kiln.debug.cases import load_case
    from kiln.debug.diff import format_report, run_diff
    from kiln.errors import ConfigError

    modes = [m.strip() for m in args.modes.split(",")]
    if len(modes) != 2:
        raise ConfigError(f"--modes {args.modes!r}: expected REFERENCE,TEST, e.g. eager,captured")
    if args.case:
        case = load_case(args.case)
        session = _open(args, case)
        reference = case.reference
    else:
        session = _open(args)
        reference = _reference(session, args, modes[0])
    ref_label = f"case {args.case}" if args.case else modes[0]
    report = run_diff(session, reference, modes[1], ref_label, _piece_modes(args))
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report))
    return 1 if report.first_divergence is not None else 0


def cmd_bisect(args: argparse.Namespace) -> int:
    from kiln.compile.split import op_name
    from kiln.debug.bisect import Bisector, command_check
    from kiln.debug.cases import load_case
    from kiln.debug.diff import run_diff

    case = load_case(args.case) if args.case else None
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    session = _open(args, case)
    if args.check:
        fails = command_check(args.check, log)
    else:
        reference = case.reference if case is not None else _reference(session, args)

        def fails(modes: dict) -> bool:
            return run_diff(session, reference, "captured", "eager", modes).first_divergence is not None

    result = Bisector(len(session.graph.pieces), fails, log).run()
    culprits = []
    for idx in result.culprits:
        piece = session.graph.pieces[idx]
        nodes = piece.graph.graph.nodes
        ops = sorted({op_name(n.target) for n in nodes if n.op in ("call_function", "call_method")})
        culprits.append({"piece": idx, "describe": piece.describe(), "modules": piece.info.module_paths, "ops": ops})
    if args.json:
        rounds = [{"round": r.number, "pieces": r.suspects, "mode": r.mode, "failed": r.failed} for r in result.rounds]
        out = {"culprits": culprits, "rounds": rounds, "verdict": result.verdict}
        print(json.dumps({**out, "fails_compiled": result.fails_compiled}, indent=1))
        return 0
    for c in culprits:
        print(f"Culprit: piece {c['piece']} ({c['describe']})")
        print(f"  modules: {', '.join(c['modules'])}")
        print(f"  ops: {', '.join(c['ops'])}")
    print(f"Bisect done in {len(result.rounds)} rounds: {result.verdict}")
    return 0


def cmd_save_case(args: argparse.Namespace) -> int:
    from kiln.debug.cases import save_case
    from kiln.debug.diff import format_report, run_diff

    session = _open(args)
    reference = _reference(session, args)
    report = run_diff(session, reference, args.mode, "eager", _piece_modes(args))
    directory = save_case(Path(args.out), session, reference, report, args.mode)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(format_report(report))
        print(f"Saved debug case to {directory} ({len(session.boundaries)} boundaries, {args.num_decode + 1} steps)")
    return 0


def cmd_check_case(args: argparse.Namespace) -> int:
    from kiln.debug.cases import load_case
    from kiln.debug.diff import format_report, run_diff

    case = load_case(args.case_dir)
    session = _open(args, case)
    mode = args.mode or case.test_mode
    report = run_diff(session, case.reference, mode, "eager", _piece_modes(args))
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report))
    first = report.first_divergence
    if first is None:
        print(f"check-case {args.case_dir}: pass ({len(report.boundaries)} boundaries within their thresholds)")
        return 0
    print(
        f"check-case {args.case_dir}: REGRESSION at boundary {first.name} ({first.module}, piece {first.piece}): "
        f"rel_diff {first.rel_diff:.3g} > threshold {first.threshold:.3g}",
        file=sys.stderr,
    )
    return 1


def cmd_explain(args: argparse.Namespace) -> int:
    from kiln.compile.settings import graph_config_from
    from kiln.config import parse_dtype
    from kiln.debug.explain import explain_model
    from kiln.debug.session import is_factory_spec, load_factory
    from kiln.engine.model_runner import ModelRunner
    from kiln.log import setup_logging

    setup_logging()
    recipe = None
    if args.recipe:  # the recipe's dtype and splitting ops, as the engine would use them
        from kiln.recipe import load_recipe

        recipe = load_recipe(args.recipe, model=args.model)
    dtype = parse_dtype(recipe.dtype if recipe is not None else args.dtype)
    if is_factory_spec(args.model):
        model = load_factory(args.model).to(device=args.device, dtype=dtype)
    else:
        from kiln.model.loader import open_checkpoint
        from kiln.model.registry import build_model

        model = build_model(open_checkpoint(args.model), dtype, 2048, args.device)
    model.eval().requires_grad_(False)
    runner = ModelRunner(model, 2, args.block_size, dtype, ())
    splitting_ops = graph_config_from(recipe).splitting_ops
    explanation = explain_model(model, runner.kv_caches, tuple(splitting_ops))
    print(explanation.format())
    return 1 if explanation.findings else 0
