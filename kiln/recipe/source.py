"""Recipe YAML with source positions: every key and value keeps the line and column it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from kiln.recipe.diagnostics import Diagnostic, RecipeError, Severity

KeyPath = tuple[str | int, ...]  # keys and list indices from the document root
Position = tuple[int, int]  # 1-based (line, col)

# NOTE: aliases can expand exponentially ("billion laughs"); no real recipe comes near this many nodes.
MAX_NODES = 20_000


@dataclass(frozen=True)
class SourceDoc:
    """A parsed recipe: plain Python data plus where each key and value sits in the file."""

    file: str
    text: str
    data: dict[str, Any]
    values: dict[KeyPath, Position] = field(default_factory=dict)
    keys: dict[KeyPath, Position] = field(default_factory=dict)

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def source_line(self, line: int) -> str | None:
        lines = self.lines
        return lines[line - 1] if 0 < line <= len(lines) else None

    def position(self, path: KeyPath, key: bool = False) -> Position:
        """Where `path` is written; falls back to the closest enclosing entry when it is absent (a missing key)."""
        path = tuple(path)
        while path:
            for table in (self.keys, self.values) if key else (self.values, self.keys):
                if path in table:
                    return table[path]
            path = path[:-1]
            key = True
        return (1, 1)

    def at(self, severity: Severity, message: str, line: int, col: int, length: int = 1) -> Diagnostic:
        return Diagnostic(
            self.file,
            line,
            col=col,
            severity=severity,
            message=message,
            source_line=self.source_line(line),
            length=max(length, 1),
        )

    def diagnostic(self, severity: Severity, message: str, path: KeyPath, key: bool = False) -> Diagnostic:
        line, col = self.position(path, key)
        return self.at(severity, message, line, col)


def parse_source(text: str, file: str) -> SourceDoc:
    """Parse YAML text (duplicate keys rejected); raise RecipeError with the YAML error's position."""
    return source_doc(load_mapping(text, file), text, file)


def load_mapping(text: str, file: str) -> CommentedMap:
    """The YAML text as ruamel's round-trip mapping (comments and positions kept); RecipeError for invalid YAML or
    a document that is not a mapping."""
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    try:
        root = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        raise RecipeError([_diag(text, file, line=line, col=col, message=f"invalid YAML: {problem}")]) from None
    except (YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # NOTE: the constructor raises plain ValueError for impossible timestamps such as 2024-13-45.
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecipeError([_diag(text, file, line=1, col=1, message=f"invalid YAML: {message}")]) from None
    written = [line.strip() for line in text.splitlines() if line.strip()]
    if root is None and written and all(line.startswith("#") for line in written):
        message = "the recipe has only comments; expected a mapping with recipe_version, model, ..."
        raise RecipeError([_diag(text, file, line=1, col=1, message=message)])
    if not isinstance(root, CommentedMap):
        found = f"a {type(root).__name__}" if root is not None else ("null" if written else "an empty file")
        raise RecipeError(
            [
                _diag(
                    text,
                    file,
                    line=1,
                    col=1,
                    message=f"a recipe must be a YAML mapping (recipe_version, model, ...), found {found}",
                )
            ]
        )
    return root


def source_doc(root: CommentedMap, text: str, file: str) -> SourceDoc:
    """Plain data and positions of a loaded mapping; RecipeError for keys that are not names or too many nodes."""
    builder = _Builder(text, file)
    data = builder.convert(root, ())
    if builder.errors:
        raise RecipeError(builder.errors)
    return SourceDoc(file, text, data=data, values=builder.values, keys=builder.keys)


def _diag(text: str, file: str, line: int, col: int, message: str) -> Diagnostic:
    lines = text.splitlines()
    source = lines[line - 1] if 0 < line <= len(lines) else None
    return Diagnostic(file, line, col=col, severity="error", message=message, source_line=source)


class _Builder:
    """Turns ruamel's round-trip nodes into plain dicts, lists and scalars, recording positions on the way."""

    def __init__(self, text: str, file: str) -> None:
        self.text, self.file = text, file
        self.values: dict[KeyPath, Position] = {}
        self.keys: dict[KeyPath, Position] = {}
        self.errors: list[Diagnostic] = []
        self.nodes = 0

    def convert(self, node: Any, path: KeyPath) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            if not self.errors:
                self.errors.append(
                    _diag(
                        self.text,
                        self.file,
                        line=1,
                        col=1,
                        message=f"recipe too large: more than {MAX_NODES} YAML nodes after expanding aliases",
                    )
                )
            return None
        # NOTE: ruamel resolves an alias to its own anchor as null, so the tree has no cycles to guard against.
        if isinstance(node, CommentedMap):
            return self._map(node, path)
        if isinstance(node, CommentedSeq):
            return self._seq(node, path)
        return _scalar(node)

    def _map(self, node: CommentedMap, path: KeyPath) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in node:
            pos = _lc(node.lc.key, key)
            if not isinstance(key, str):
                line, col = pos or self.values.get(path, (1, 1))
                self.errors.append(
                    _diag(self.text, self.file, line=line, col=col, message=f"keys must be names, found {key!r}")
                )
                continue
            child = (*path, key)
            if pos is not None:
                self.keys[child] = pos
            value_pos = _lc(node.lc.value, key)
            if value_pos is not None:
                self.values[child] = value_pos
            out[key] = self.convert(node[key], child)
        return out

    def _seq(self, node: CommentedSeq, path: KeyPath) -> list[Any]:
        out = []
        for i, item in enumerate(node):
            pos = _lc(node.lc.item, i)
            if pos is not None:
                self.values[(*path, i)] = pos
            out.append(self.convert(item, (*path, i)))
        return out


def _lc(getter: Any, key: Any) -> Position | None:
    """ruamel's 0-based (line, col) made 1-based; None where ruamel kept no position (merged keys)."""
    try:
        line, col = getter(key)
    except (KeyError, IndexError, TypeError):
        return None
    return (line + 1, col + 1)


def _scalar(value: Any) -> Any:
    """ruamel's scalar subclasses (ScalarFloat, ScalarBoolean, ...) as plain Python values; others unchanged."""
    if isinstance(value, bool) or type(value).__name__ == "ScalarBoolean":
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value
