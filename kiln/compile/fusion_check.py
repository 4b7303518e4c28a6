"""The fusion contract: after compiling, every fusion group with `required: true` must be realised.

`check_fusion` runs once per engine compile (GraphExecutor.prepare), on the dynamic code of the first piece that
holds each group (kiln.compile.fusion says what realised means), and again on the full decode graph's code where
the graph mode has one (its layer units: decode-only steps run it, so it keeps the same contract). A realised group
logs `Fusion applied: NAME` (`... in the full decode graph`) with the kernels that realise it; an unrealised
required group fails the compile with a FusionGroupError citing its recipe line; an optional one logs a warning.
A group with no generated code to check (the eager compiler, eager pieces) is logged as not checked: the contract
binds code generation, and there is none to bind.

`check_quantized` holds groups to their `all_ops_quantized` claim on the loaded model, in every mode: each weight op
of the group (gate_proj lives in the fused gate_up_proj) must run packed codes no wider than the claim.
"""

from __future__ import annotations

import logging

from torch import nn

from kiln.compile.fusion import FusionReport, fusion_reports
from kiln.compile.fusion_match import CheckedCode
from kiln.config import FusionGroupConfig, GraphConfig
from kiln.errors import KilnError
from kiln.quant.linear import PackedEmbedding, PackedLinear

logger = logging.getLogger("kiln")


class FusionGroupError(KilnError):
    """Required fusion groups the compiled code does not realise: one line each, citing the recipe."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def check_fusion(codes: list[CheckedCode], config: GraphConfig, graph: str = "") -> list[FusionReport]:
    """Report every fusion group of `config` on `codes` (the pieces, or with `graph` naming it, another graph's
    code: `the full decode graph`); raise FusionGroupError for the required ones not realised."""
    reports = fusion_reports(codes, config.fusion_groups, config.compiler)
    where = f" in {graph}" if graph else ""
    problems = []
    for group, report in zip(config.fusion_groups, reports, strict=True):
        if report.realised:
            logger.info("Fusion applied: %s%s (%s)", group.name, where, " -> ".join(report.kernels))
        elif not report.checked:
            logger.info("Fusion not checked: %s%s (%s)", group.name, where, report.reason)
        elif group.required:
            problems.append(_problem(group, report, where))
        else:
            logger.warning("%s", _problem(group, report, where))
    if problems:
        raise FusionGroupError(problems)
    return reports


def _problem(group: FusionGroupConfig, report: FusionReport, where: str) -> str:
    recipe = f"{group.where}: " if group.where else ""
    kind = "required" if group.required else "optional"
    text = f"{recipe}fusion group {group.name} ({kind}) not realised{where}: {report.reason}"
    if group.required:
        text += f"; remove {report.broken_by} from the group, or set required: false to compile without it"
    return text


# module ops -> the fused module kiln runs them in
_FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_FUSED_INTO |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def check_quantized(model: nn.Module, groups: tuple[FusionGroupConfig, ...]) -> None:
    """Raise FusionGroupError for groups whose `all_ops_quantized` claim the model's weights break."""
    problems = []
    for group in groups:
        if group.all_ops_quantized is None:
            continue
        limit = int(group.all_ops_quantized.removeprefix("int"))
        for op in group.ops:
            home = _FUSED_INTO.get(op, op)
            found = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == home]
            wide = next(((n, m) for n, m in found if not _packed_within(m, limit)), None)
            if wide is not None:
                where = f"{group.where}: " if group.where else ""
                runs = f"{wide[1].bits}-bit codes" if _is_packed(wide[1]) else "unquantized weights"
                problems.append(
                    f"{where}fusion group {group.name} claims all_ops_quantized: {group.all_ops_quantized}, but {op} "
                    f"runs {runs} ({wide[0]}); set quantization.weights, or drop the claim"
                )
                break
    if problems:
        raise FusionGroupError(problems)


def _is_packed(module: nn.Module) -> bool:
    return isinstance(module, (PackedLinear, PackedEmbedding))


def _packed_within(module: nn.Module, bits: int) -> bool:
    has_weight = any(True for _ in module.parameters(recurse=False)) or _is_packed(module)
    return not has_weight or (_is_packed(module) and module.bits <= bits)
