"""Debug cases: a saved input, its expected outputs and per-boundary thresholds, replayable as a regression test.

A case directory holds
- `case.json`: model spec, recipe, dtype, compiler and capture sizes; prompt ids, decode steps, sampling (greedy),
  seed, speculation and the cached prefix (kiln.debug.runs); expected tokens; per boundary: module, piece, noise
  floor, threshold and the statistics of the path under test when the case was saved; an environment fingerprint
  (torch version, device, recipe hash, kiln version); with `--lora`, the adapter (kiln.debug.case_adapter: name,
  directory, rank, `--max-lora-rank`, its files' SHA-256), which a replay runs again once its files are checked.
- `tensors.safetensors`: input ids and positions as fed (prefill then decodes), the expected tokens and each
  boundary's reference values (`boundary.<name>`, logits included).

`check-case` replays the inputs on the path under test, teacher-forced to the expected tokens, and holds every
boundary to the saved threshold; the first boundary over its threshold is the regression. The pytest plugin
(kiln/debug/pytest_plugin.py) collects `case.json` files as tests.
"""

from __future__ import annotations

import json
import logging
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import kiln
from kiln.debug.case_adapter import adapter_record, case_lora_request
from kiln.debug.diff import NOISE_FLOOR, NOISE_RATIO, DiffReport, Reference
from kiln.debug.session import DebugSession
from kiln.engine.setup.args import EngineArgs
from kiln.errors import ConfigError
from kiln.lora.request import LoRARequest

logger = logging.getLogger("kiln")

CASE_FILE = "case.json"
TENSOR_FILE = "tensors.safetensors"
CASE_VERSION = 1


@dataclass
class Case:
    directory: Path
    meta: dict[str, Any]
    reference: Reference

    @property
    def test_mode(self) -> str:
        return str(self.meta["test_mode"])

    def engine_args(self) -> EngineArgs:
        """The engine arguments the case was saved with."""
        m = self.meta
        spec = m.get("speculative") or {}
        lora = m.get("lora")
        return EngineArgs(
            model=m["model"],
            recipe=m.get("recipe"),
            dtype=m["dtype"],
            device=m["fingerprint"]["device"],
            compiler=m.get("compiler"),
            capture_sizes=tuple(m["capture_sizes"]) if m.get("capture_sizes") else None,
            block_size=m.get("block_size", 16),
            seed=m["seed"],
            # a case saved with speculation replays its verification steps (teacher-forced drafts: no proposer runs)
            speculative_method="ngram" if spec.get("method") and not m.get("recipe") else None,
            num_speculative_tokens=spec.get("num_tokens") or 4,
            **({"enable_lora": True, "max_lora_rank": lora["max_lora_rank"]} if lora is not None else {}),
        )

    def lora_request(self) -> LoRARequest | None:
        """The adapter the case was saved with (None: the base model), its files checked against the record."""
        return case_lora_request(self.meta.get("lora"), self.directory / CASE_FILE)


def fingerprint(session: DebugSession) -> dict[str, Any]:
    recipe = session.recipe
    return {
        "torch": torch.__version__,
        "device": session.graph.device.type,
        "recipe_hash": getattr(recipe, "hash", None) if recipe is not None else None,
        "kiln": kiln.__version__,
        "python": platform.python_version(),
    }


def save_case(directory: Path, session: DebugSession, reference: Reference, report: DiffReport, test_mode: str) -> Path:
    """Write `reference` (and the test path's statistics in `report`) as a case in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    opts = session.args
    spec = session.engine.config.speculative
    tensors = {
        "input_ids": torch.tensor(reference.input_ids, dtype=torch.long),
        "positions": torch.tensor(reference.positions, dtype=torch.long),
        "expected_tokens": torch.tensor(reference.tokens, dtype=torch.long),
    }
    for name, value in reference.boundaries.items():
        tensors[f"boundary.{name}"] = value.contiguous()
    save_file(tensors, str(directory / TENSOR_FILE))
    by_name = {r.name: r for r in report.boundaries}
    meta = {
        "version": CASE_VERSION,
        "model": opts.model,
        "recipe": opts.recipe,
        "dtype": opts.dtype,
        "compiler": session.graph.config.compiler,
        "capture_sizes": list(session.graph.capture_sizes),
        "block_size": session.engine.runner.block_size,
        "seed": session.engine.config.seed,
        "test_mode": test_mode,
        "prompt_ids": reference.prompt,
        "num_decode": reference.num_decode,
        "sampling": {"temperature": 0.0, "max_tokens": reference.num_decode + 1, "ignore_eos": True},
        "expected_tokens": reference.tokens,
        "step_rows": reference.step_rows,
        "logit_rows": reference.logit_rows,
        "cached_prefix": session.runs.cached_prefix,
        "speculative": {"method": spec.method, "num_tokens": spec.num_speculative_tokens},
        "lora": adapter_record(session.runs.lora, session.engine.config.lora.max_lora_rank),
        "noise_ratio": NOISE_RATIO,
        "noise_floor": NOISE_FLOOR,
        "boundaries": [
            {
                "name": b.name,
                "module": b.module_path,
                "piece": b.piece,
                "noise": reference.noise[b.name],
                "threshold": reference.thresholds[b.name],
                "at_save": {k: v for k, v in asdict(by_name[b.name]).items() if k not in ("name", "module", "piece")},
            }
            for b in session.boundaries
        ],
        "faults_at_save": report.faults,
        "fingerprint": fingerprint(session),
    }
    (directory / CASE_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return directory


def load_case(directory: Path | str) -> Case:
    directory = Path(directory)
    meta_path, tensor_path = directory / CASE_FILE, directory / TENSOR_FILE
    if not meta_path.is_file() or not tensor_path.is_file():
        raise ConfigError(f"{directory} is not a debug case: expected {CASE_FILE} and {TENSOR_FILE} in it")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{meta_path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if meta.get("version") != CASE_VERSION:
        raise ConfigError(f"{meta_path}: case version {meta.get('version')!r}, this kiln reads version {CASE_VERSION}")
    tensors = load_file(str(tensor_path))
    bounds = meta["boundaries"]
    missing = [b["name"] for b in bounds if f"boundary.{b['name']}" not in tensors]
    if missing:
        raise ConfigError(f"{tensor_path}: no tensors for boundaries {missing}: the case is incomplete")
    reference = Reference(
        prompt=list(meta["prompt_ids"]),
        num_decode=int(meta["num_decode"]),
        tokens=list(meta["expected_tokens"]),
        step_rows=list(meta["step_rows"]),
        logit_rows=list(meta.get("logit_rows") or [1] * len(meta["step_rows"])),
        boundaries={b["name"]: tensors[f"boundary.{b['name']}"] for b in bounds},
        noise={b["name"]: float(b["noise"]) for b in bounds},
        thresholds={b["name"]: float(b["threshold"]) for b in bounds},
        input_ids=tensors["input_ids"].tolist(),
        positions=tensors["positions"].tolist(),
    )
    return Case(directory, meta, reference)


def fingerprint_changes(case: Case, session: DebugSession) -> list[str]:
    """What differs between the environment that saved the case and this one (reported, not failed on)."""
    now = fingerprint(session)
    saved = case.meta["fingerprint"]
    return [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in now.items() if saved.get(k) != v]


def check_names(case: Case, session: DebugSession) -> None:
    """The session's model must have the case's boundaries, in the same pieces."""
    saved = [(b["name"], b["piece"]) for b in case.meta["boundaries"]]
    now = [(b.name, b.piece) for b in session.boundaries]
    if saved != now:
        raise ConfigError(
            f"{case.directory}: the case's boundaries {len(saved)} do not match this model's {len(now)} "
            "(a different model or graph split); save the case again"
        )
