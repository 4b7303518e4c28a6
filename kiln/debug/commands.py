"""Handlers of `kiln debug ...` (parsers in kiln.debug.cli): open a session from the engine flags, run, report."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

from kiln.compile.modes import PieceMode, parse_piece_modes
from kiln.compile.split import op_name
from kiln.debug.bisect import Bisector, command_check, format_indices
from kiln.debug.case_adapter import DEBUG_LORA_ID
from kiln.debug.cases import Case, check_names, fingerprint_changes, load_case, save_case
from kiln.debug.cli import DEFAULT_PROMPT
from kiln.debug.diff import Reference, build_reference, format_report, run_diff
from kiln.debug.explain import explain_model
from kiln.debug.faults import inject, parse_fault
from kiln.debug.ranks import RankReport, check_same_pieces, is_first_rank, report_per_rank, stage_culprits
from kiln.debug.session import DebugSession, is_factory_spec, load_factory
from kiln.distributed.spmd import agree_any
from kiln.engine.setup.args import EngineArgs
from kiln.engine.setup.resolve import resolve_engine_config
from kiln.errors import ConfigError
from kiln.log import setup_logging
from kiln.lora.request import LoRARequest
from kiln.model.attention import allocate_kv_caches
from kiln.model.build import build_model
from kiln.model.dtypes import parse_dtype
from kiln.model.loader import open_checkpoint


def engine_args(args: argparse.Namespace, case: Case | None = None) -> EngineArgs:
    """The engine flags; with a case, the case's own settings where a flag is left at its default."""
    given = EngineArgs.from_cli_args(args)
    if case is None:
        return given
    defaults = EngineArgs()
    names = [f.name for f in fields(EngineArgs)]
    explicit = {n: getattr(given, n) for n in names if getattr(given, n) != getattr(defaults, n)}
    return replace(case.engine_args(), **explicit)


def _open(args: argparse.Namespace, case: Case | None = None) -> DebugSession:
    setup_logging()
    faults = [parse_fault(spec) for spec in args.inject_fault]
    cached = case.meta.get("cached_prefix", 0) if case is not None else getattr(args, "cached_prefix", 0)
    session = DebugSession.open(engine_args(args, case), cached, _lora(args, case))
    if case is not None:
        check_names(case, session)
        for change in fingerprint_changes(case, session):
            print(f"Note: environment differs from when the case was saved: {change}", file=sys.stderr)
    for fault in faults:
        print(f"Injected fault {inject(session, fault)}", file=sys.stderr)
    return session


def lora_request(spec: str | None) -> LoRARequest | None:
    """`--lora NAME=PATH` as the adapter the debug request runs with; ConfigError for another form."""
    if spec is None:
        return None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora {spec!r}: expected NAME=PATH (a PEFT adapter directory)")
    return LoRARequest(name, DEBUG_LORA_ID, path)


def _lora(args: argparse.Namespace, case: Case | None) -> LoRARequest | None:
    """The adapter of the session: `--lora`, or with a case the one it was saved with (its files checked); a
    `--lora` naming another adapter than the case's is refused."""
    given = lora_request(getattr(args, "lora", None))
    if case is None:
        return given
    saved = case.lora_request()
    if given is not None and (saved is None or Path(given.lora_path).resolve() != Path(saved.lora_path)):
        was = f"LoRA adapter {saved.lora_path}" if saved is not None else "no LoRA adapter"
        raise ConfigError(
            f"--lora {args.lora}: the case {case.directory} was saved with {was}; leave --lora out (a case replays "
            "the adapter it was saved with)"
        )
    return saved


def _prompt(session: DebugSession, args: argparse.Namespace) -> list[int]:
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
    seed = session.engine.config.seed
    return torch.randint(0, vocab, (7,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(session: DebugSession, args: argparse.Namespace, ref_mode: str = "eager") -> Reference:
    return build_reference(session, _prompt(session, args), args.num_decode, ref_mode)


def _piece_modes(args: argparse.Namespace) -> dict[int, PieceMode]:
    return parse_piece_modes(args.piece_modes) if args.piece_modes else {}


def cmd_diff(args: argparse.Namespace) -> int:
    return report_per_rank(args, engine_args(args), diff_report)


def diff_report(args: argparse.Namespace) -> RankReport:
    """Run `kiln debug diff` on this rank: (exit code, the report as printed, its first divergence)."""
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
    report = run_diff(session, reference, test_mode=modes[1], ref_mode=ref_label, piece_modes=_piece_modes(args))
    text = json.dumps(report.as_dict(), indent=1) if args.json else format_report(report)
    first = report.first_divergence
    return RankReport(1 if first is not None else 0, text, first.name if first is not None else None)


def cmd_bisect(args: argparse.Namespace) -> int:
    return report_per_rank(args, engine_args(args), bisect_report)


def bisect_report(args: argparse.Namespace) -> RankReport:
    """Run `kiln debug bisect` on this rank: (exit code, the culprits as printed). The progress lines go to stdout
    (stderr with --json) from rank 0 only; every rank takes the same branches (`agree_any`), over piece indices
    that name a different piece on each pipeline stage: a culprit index is then checked on each stage alone."""
    case = load_case(args.case) if args.case else None
    quiet = not is_first_rank()
    log = (lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr)) if args.json else print
    session = _open(args, case)
    if args.check:
        fails = command_check(args.check, log)
    else:
        reference = case.reference if case is not None else _reference(session, args)

        def fails(modes: dict) -> bool:
            report = run_diff(session, reference, test_mode="captured", ref_mode="eager", piece_modes=modes)
            return agree_any(report.first_divergence is not None)

    full_fails = False
    if session.graph.full is not None and not args.check:  # round 0: the full decode graph, before its pieces
        full_fails = agree_any(run_diff(session, reference, "captured", "eager").first_divergence is not None)
        verdict = "FAIL" if full_fails else "pass"
        log(f"round 0: the full decode graph for decode steps, every piece captured: {verdict}")
    check_same_pieces(len(session.graph.pieces))
    result = Bisector(len(session.graph.pieces), fails, log).run()
    if full_fails and not result.rounds[0].failed:
        result.verdict = (
            "the full decode graph fails but its pieces, every one captured, do not: the fault is in the full "
            "decode graph (traced attention or its compile); work around with --graph-mode piecewise"
        )
    culprits = []
    mine = stage_culprits(session, result.culprits, reference if not args.check else None)
    for idx in mine:
        piece = session.graph.pieces[idx]
        nodes = piece.graph.graph.nodes
        ops = sorted({op_name(n.target) for n in nodes if n.op in ("call_function", "call_method")})
        culprits.append({"piece": idx, "describe": piece.describe(), "modules": piece.info.module_paths, "ops": ops})
    if args.json:
        rounds = [{"round": r.number, "pieces": r.suspects, "mode": r.mode, "failed": r.failed} for r in result.rounds]
        out = {"culprits": culprits, "rounds": rounds, "verdict": result.verdict}
        return RankReport(0, json.dumps({**out, "fails_compiled": result.fails_compiled}, indent=1))
    lines = []
    for c in culprits:
        lines.append(f"Culprit: piece {c['piece']} ({c['describe']})")
        lines.append(f"  modules: {', '.join(c['modules'])}")
        lines.append(f"  ops: {', '.join(c['ops'])}")
    if clean := [i for i in result.culprits if i not in mine]:
        lines.append(f"Clean on this rank: piece {format_indices(clean)} (that index is the culprit on another stage)")
    lines.append(f"Bisect done in {len(result.rounds)} rounds: {result.verdict}")
    return RankReport(0, "\n".join(lines))


def cmd_save_case(args: argparse.Namespace) -> int:
    session = _open(args)
    reference = _reference(session, args)
    report = run_diff(session, reference, test_mode=args.mode, ref_mode="eager", piece_modes=_piece_modes(args))
    directory = save_case(Path(args.out), session, reference=reference, report=report, test_mode=args.mode)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(format_report(report))
        print(f"Saved debug case to {directory} ({len(session.boundaries)} boundaries, {args.num_decode + 1} steps)")
    return 0


def cmd_check_case(args: argparse.Namespace) -> int:
    case = load_case(args.case_dir)
    session = _open(args, case)
    mode = args.mode or case.test_mode
    report = run_diff(session, case.reference, test_mode=mode, ref_mode="eager", piece_modes=_piece_modes(args))
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
    setup_logging()
    # NOTE: the config (not the flags) decides: a recipe's dtype and splitting ops, as the engine would use them
    config = resolve_engine_config(EngineArgs.from_cli_args(args))
    dtype = parse_dtype(config.dtype)
    if is_factory_spec(config.model):
        model = load_factory(config.model).to(device=config.device, dtype=dtype)
    else:
        model = build_model(open_checkpoint(config.model), dtype, 2048, config.device)
    model.eval().requires_grad_(False)
    kv_caches = allocate_kv_caches(
        model.config, num_blocks=2, block_size=config.cache.block_size, dtype=dtype, device=config.device
    )
    explanation = explain_model(model, kv_caches, tuple(config.graph.splitting_ops))
    print(explanation.format())
    return 1 if explanation.findings else 0
