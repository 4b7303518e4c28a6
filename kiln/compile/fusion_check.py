"""The fusion contract: after compiling, every fusion group with `required: true` must be realised.

`check_fusion` runs once per engine compile (GraphExecutor.prepare), on the dynamic code of the first piece that
holds each group (kiln.compile.fusion says what realised means). A realised group logs `Fusion applied: NAME`; an
unrealised required group fails the compile with a FusionGroupError citing its recipe line; an optional one logs a
warning. A group with no generated code to check (the eager compiler, eager pieces) is logged as not checked: the
contract binds code generation, and there is none to bind.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kiln.compile.fusion import FusionReport, fusion_reports
from kiln.config import FusionGroupConfig, GraphConfig
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.compile.piece import Piece

logger = logging.getLogger("kiln")


class FusionGroupError(KilnError):
    """Required fusion groups the compiled code does not realise: one line each, citing the recipe."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def check_fusion(pieces: list[Piece], config: GraphConfig) -> list[FusionReport]:
    """Report every fusion group of `config`; raise FusionGroupError for the required ones not realised."""
    reports = fusion_reports(pieces, config.fusion_groups, config.compiler)
    problems = []
    for group, report in zip(config.fusion_groups, reports, strict=True):
        if report.realised:
            logger.info("Fusion applied: %s (%s)", group.name, " -> ".join(report.kernels))
        elif not report.checked:
            logger.info("Fusion not checked: %s (%s)", group.name, report.reason)
        elif group.required:
            problems.append(_problem(group, report))
        else:
            logger.warning("%s", _problem(group, report))
    if problems:
        raise FusionGroupError(problems)
    return reports


def _problem(group: FusionGroupConfig, report: FusionReport) -> str:
    where = f"{group.where}: " if group.where else ""
    kind = "required" if group.required else "optional"
    text = f"{where}fusion group {group.name} ({kind}) not realised: {report.reason}"
    if group.required:
        text += f"; remove {report.broken_by} from the group, or set required: false to compile without it"
    return text
