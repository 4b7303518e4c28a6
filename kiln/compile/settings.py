"""Graph settings: the recipe is the source of truth; flags fill in or override, and every override is logged
(the graph-settings part of the one precedence every field follows, kiln/engine/setup/recipe_config.py).

The graph mode is one value (kiln.graph_mode.GraphMode): the recipe's `graph.mode` (or, unset, what `graph.piecewise`
implies: full_and_piecewise, or full when false), else the default full_and_piecewise; `--graph-mode` (or one of
its aliases, resolved by `kiln.engine.setup.args`) overrides it like any other graph flag.

`graph_config_from` is the one place a GraphConfig is built and validated (called once, by
`EngineArgs.create_engine_config`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import fields, replace
from typing import Any

from kiln.compile.modes import PieceMode, parse_piece_modes
from kiln.config import COMPILER_NAMES, FusionGroupConfig, GraphConfig
from kiln.errors import ConfigError
from kiln.graph_mode import DEFAULT_GRAPH_MODE, GRAPH_MODES, GraphMode

logger = logging.getLogger("kiln")
_RECIPE_FIELDS = ("mode", "splitting_ops", "capture_sizes", "compile_sizes", "compiler")


def graph_config_from(recipe: Any | None = None, **cli_overrides: Any) -> GraphConfig:
    """A GraphConfig from a recipe (any object with `graph_mode`, `splitting_ops`, `capture_sizes`, `compiler`,
    `hash`, `fusion_groups` of {name, ops, required}; optionally `path` and `fusion_lines`, the line of each group)
    or defaults, then CLI overrides (None = not given).

    Keys of `cli_overrides` are GraphConfig field names; `piece_modes` may be a `0-3:captured,4:eager` string.
    An override that changes a value the recipe set is logged, so the recipe is never silently rewritten.
    """
    base = GraphConfig()
    if recipe is not None:
        base = replace(
            base,
            mode=_graph_mode(getattr(recipe, "graph_mode", None) or DEFAULT_GRAPH_MODE),
            splitting_ops=tuple(recipe.splitting_ops),
            capture_sizes=tuple(recipe.capture_sizes),
            compile_sizes=_optional_sizes(getattr(recipe, "compile_sizes", None)),
            compiler=str(recipe.compiler),
            recipe_hash=str(recipe.hash),
            debug=1 if getattr(recipe, "debug_mode", False) else 0,
            fusion_groups=_fusion_groups(
                recipe.fusion_groups, str(getattr(recipe, "path", "")), tuple(getattr(recipe, "fusion_lines", ()))
            ),
        )
    known = {f.name for f in fields(GraphConfig)}
    unknown = sorted(set(cli_overrides) - known)
    if unknown:
        raise ConfigError(f"unknown graph settings {unknown}: expected some of {sorted(known)}")
    changes: dict[str, Any] = {}
    for name, value in cli_overrides.items():
        if value is None:
            continue
        if name == "mode":
            value = _graph_mode(value)
        elif name == "piece_modes":
            value = tuple(sorted((i, m.value) for i, m in parse_piece_modes(value).items()))
        elif name in ("splitting_ops", "capture_sizes"):
            value = tuple(value)
        elif name == "compile_sizes":
            value = _optional_sizes(value)
        elif name == "fusion_groups":
            value = _fusion_groups(value)
        if recipe is not None and name in _RECIPE_FIELDS and value != getattr(base, name):
            logger.info("Graph setting %s=%s overrides the recipe's %s", name, value, getattr(base, name))
        changes[name] = value
    config = replace(base, **changes)
    _validate(config)
    return config


def _graph_mode(name: str | GraphMode) -> GraphMode:
    try:
        return GraphMode(name)
    except ValueError:
        raise ConfigError(f"graph mode {name!r}: expected one of {', '.join(GRAPH_MODES)}") from None


def _optional_sizes(sizes: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(sizes)


def _fusion_groups(groups: Iterable[Any], path: str = "", lines: tuple[int, ...] = ()) -> tuple[FusionGroupConfig, ...]:
    """Groups from a recipe (or dicts) with where each is written, `path:LINE`, for the fusion check's messages."""
    out = []
    for i, g in enumerate(groups):
        where = f"{path}:{lines[i]}" if path and i < len(lines) else path
        ops = tuple(str(op) for op in _field(g, "ops"))
        quantized = _field(g, "all_ops_quantized")
        name, required = str(_field(g, "name")), bool(_field(g, "required", True))
        out.append(FusionGroupConfig(name, ops, required, where, None if quantized is None else str(quantized)))
    return tuple(out)


def _field(group: Any, key: str, default: Any = None) -> Any:
    return group.get(key, default) if isinstance(group, dict) else getattr(group, key, default)


def _validate(config: GraphConfig) -> None:
    if config.compiler not in COMPILER_NAMES:
        raise ConfigError(f"graph compiler {config.compiler!r}: expected one of {', '.join(COMPILER_NAMES)}")
    if config.default_piece_mode not in set(PieceMode):
        raise ConfigError(
            f"default piece mode {config.default_piece_mode!r}: expected one of {', '.join(m.value for m in PieceMode)}"
        )
    bad = [s for s in config.capture_sizes if not isinstance(s, int) or s < 1]
    if bad:
        raise ConfigError(f"capture sizes must be positive integers, got {bad}")
    if len(set(config.capture_sizes)) != len(config.capture_sizes):
        raise ConfigError(f"capture sizes {list(config.capture_sizes)} contain duplicates")
    if config.compile_sizes is not None:
        bad = [s for s in config.compile_sizes if not isinstance(s, int) or s not in config.capture_sizes]
        if bad:
            raise ConfigError(
                f"compile sizes {bad} are not capture sizes {sorted(config.capture_sizes)}: a static compile "
                "is only run by the capture of its size"
            )
        if config.compile_sizes and config.compiler != "inductor":
            raise ConfigError(
                f"compile sizes {list(config.compile_sizes)} need the inductor compiler; the "
                f"{config.compiler} compiler runs the traced graph as is (set compile sizes to none)"
            )
    if config.mode.is_graph and config.mode.splits_forward and not config.splitting_ops:
        raise ConfigError(f"graph mode {config.mode} needs at least one splitting op (default: kiln.attention)")


def graph_mode_from_flags(
    graph_mode: str | None, enforce_eager: bool, full_graph: bool, enable_piecewise_graph: bool
) -> str | None:
    """The graph mode the flags name (None: none does), from --graph-mode or one of its aliases (each use of an
    alias logged); flags naming two modes are refused."""
    named = {
        "--graph-mode": graph_mode,
        "--enforce-eager": "eager" if enforce_eager else None,
        "--full-graph": "full" if full_graph else None,
    }
    given = {flag: mode for flag, mode in named.items() if mode is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{flag} ({mode})" for flag, mode in given.items())
        raise ConfigError(f"the graph-mode flags disagree: {listed}; give one --graph-mode")
    for flag, mode in given.items():
        if flag != "--graph-mode":
            logger.info("%s is an alias of --graph-mode %s", flag, mode)
    if enable_piecewise_graph:
        logger.info("--enable-piecewise-graph: graph mode is on by default (kept as an alias)")
    return next(iter(given.values()), None)
