"""Schema validation with diagnostics for people: the key's line and column, "did you mean" for near misses, the
kiln spelling of community keys; and, on errors, a partial spec so the checks after the schema still run."""

from __future__ import annotations

import copy
import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from kiln.recipe.community import community_hint, community_shape_hint
from kiln.recipe.diagnostics import Diagnostic, sort_diagnostics
from kiln.recipe.schema import RETIRED_KEYS, RecipeSpec
from kiln.recipe.source import KeyPath, SourceDoc

MAX_PRUNING_ROUNDS = 8


def validate_schema(doc: SourceDoc) -> tuple[RecipeSpec | None, list[Diagnostic]]:
    """The recipe as a RecipeSpec and one diagnostic per schema problem, sorted by line.

    With problems, the spec is built from the data less the offending keys (so defaults apply; a missing required
    key gets a stand-in): it lets the later checks find their errors in the same pass and must never become a
    Recipe. None when even that fails."""
    try:
        return RecipeSpec.model_validate(doc.data), []
    except ValidationError as exc:
        errors = _located(doc.data, exc)
    diagnostics = sort_diagnostics(_diagnostics(doc, errors))
    data: Any = doc.data
    for _ in range(MAX_PRUNING_ROUNDS):
        # NOTE: later rounds only see what pruning removed (a deleted section is "missing"); never report them.
        data = _pruned(data, errors)
        if data is None:
            return None, diagnostics
        try:
            return RecipeSpec.model_validate(data), diagnostics
        except ValidationError as exc:
            errors = _located(data, exc)
    return None, diagnostics


def _located(data: Any, exc: ValidationError) -> list[dict]:
    """pydantic's errors with `loc` made a real path into the data (union-branch tags removed)."""
    return [{**err, "loc": _data_path(data, err["loc"])} for err in exc.errors(include_url=False)]


def _diagnostics(doc: SourceDoc, errors: list[dict]) -> list[Diagnostic]:
    # NOTE: a union (`str | int`) fails once per branch; group those into one "expected a or b" diagnostic.
    grouped: dict[tuple[KeyPath, str], list[dict]] = {}
    for err in errors:
        kind = err["type"] if err["type"] in ("extra_forbidden", "missing") else "value"
        grouped.setdefault((err["loc"], kind), []).append(err)
    return [_diagnostic(doc, errs) for errs in grouped.values()]


def _pruned(data: dict[str, Any], errors: list[dict]) -> dict[str, Any] | None:
    """A copy of `data` without the keys the errors are about; a missing required key whose section cannot go
    either gets a stand-in. None when an error is about the whole recipe."""
    data = copy.deepcopy(data)
    for err in errors:
        path: KeyPath = err["loc"]
        if err["type"] == "missing":
            stand_in = _stand_in(path)
            if stand_in is not None:
                parent = _node(data, path[:-1])
                if isinstance(parent, dict):
                    parent[path[-1]] = stand_in
                continue
            path = path[:-1]
        target = _dict_key(path)
        if not target:
            return None
        parent = _node(data, target[:-1])
        if isinstance(parent, dict):
            parent.pop(target[-1], None)
    return data


def _stand_in(path: KeyPath) -> Any:
    """A value for the missing key at `path` when its section is required too (model.name, hardware.device):
    an empty string, the first allowed literal or an empty mapping. None where dropping the section is better (an
    optional section, a list item), or no stand-in fits."""
    if any(isinstance(p, int) for p in path):
        return None
    section = _field_at(path[:-1])
    if path[:-1] and (section is None or not section.is_required()):
        return None
    annotation = _annotation_at(path)
    literals = _flatten_args(annotation, typing.Literal)
    if literals:
        return literals[0]
    if annotation is str:
        return ""  # NOTE: claims nothing, so the checks of model.name against the checkpoint stay quiet
    return {} if _inner_model(annotation) is not None else None


def _dict_key(path: KeyPath) -> KeyPath:
    """The key to delete for `path`: a list item takes its whole list, since deleting one item would shift the
    positions the later checks report at."""
    while path and isinstance(path[-1], int):
        path = path[:-1]
    return path


def _node(data: Any, path: KeyPath) -> Any:
    for part in path:
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        if not (in_dict or in_list):
            return None
        data = data[part]
    return data


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """`; did you mean 'x'?` for a close match, else an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _diagnostic(doc: SourceDoc, errors: list[dict]) -> Diagnostic:
    err = errors[0]
    path: KeyPath = err["loc"]
    where = dotted(path)
    if err["type"] == "extra_forbidden":
        key = str(path[-1])
        allowed = sorted(fields_at(path[:-1]))
        section = f"in {dotted(path[:-1])}" if path[:-1] else "at the top level"
        retired = RETIRED_KEYS.get(tuple(str(p) for p in path))
        if retired is not None:
            return doc.diagnostic("error", retired.format(file=doc.file), path, key=True)
        hint = community_hint(path[:-1], key)
        if hint is not None:
            return doc.diagnostic("error", f"unknown key {key!r} {section}; {hint}", path, key=True)
        message = f"unknown key {key!r} {section}{did_you_mean(key, allowed)}"
        if allowed:
            message += f" (expected one of: {', '.join(allowed)})"
        return doc.diagnostic("error", message, path, key=True)
    if err["type"] == "missing":
        parent = f"in {dotted(path[:-1])}" if path[:-1] else "at the top level"
        return doc.diagnostic("error", f"missing required key {str(path[-1])!r} {parent}", path[:-1], key=True)
    found = _short(err.get("input"))
    if err["type"] == "literal_error":
        hint = did_you_mean(err["input"], _literals_at(path)) if isinstance(err.get("input"), str) else ""
        return doc.diagnostic("error", f"{where}: expected {err['ctx']['expected']}, got {found}{hint}", path)
    expected = [_EXPECTED[e["type"]] for e in errors if e["type"] in _EXPECTED]
    if len(expected) == len(errors):
        reason = "expected " + " or ".join(dict.fromkeys(expected))
    else:
        reason = " or ".join(dict.fromkeys(_lower_first(e["msg"]) for e in errors))
    shape = community_shape_hint(path, err.get("input"))
    return doc.diagnostic("error", f"{where}: {reason}, got {found}" + (f"; {shape}" if shape else ""), path)


_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "list_type": "a list",
    "model_type": "a mapping",
    "dict_type": "a mapping",
}


def dotted(path: KeyPath) -> str:
    """`graph.capture_sizes[1]` for ('graph', 'capture_sizes', 1)."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "recipe"


def _data_path(data: Any, loc: tuple) -> KeyPath:
    """pydantic's error location with union-branch tags ('str', 'int', ...) removed: a real path into the data."""
    path: list[str | int] = []
    node = data
    for part in loc:
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and not _is_union_tag(part):
            node = None  # a missing key: keep it so the message can name it
        else:
            continue
        path.append(part)
    return tuple(path)


def _is_union_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "none", "list[...]", "dict[...]"} or part[:1].isupper()


def _annotation_at(path: KeyPath) -> Any:
    found = _field_at(path)
    return found.annotation if found is not None else None


def _field_at(path: KeyPath) -> FieldInfo | None:
    cls: Any = RecipeSpec
    found: FieldInfo | None = None
    for part in path:
        if isinstance(part, int):
            continue
        model = _inner_model(cls) if cls is not None else None
        if model is None or part not in model.model_fields:
            return None
        found = model.model_fields[part]
        cls = found.annotation
    return found


def fields_at(path: KeyPath) -> list[str]:
    """The keys the schema allows in the mapping at `path` (empty where no mapping belongs)."""
    model = RecipeSpec if not path else _inner_model(_annotation_at(path))
    return list(model.model_fields) if model is not None else []


def _literals_at(path: KeyPath) -> list[str]:
    return [str(v) for v in _flatten_args(_annotation_at(path), typing.Literal)]


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _flatten_args(annotation: Any, origin: Any) -> list[Any]:
    if typing.get_origin(annotation) is origin:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _flatten_args(arg, origin)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]
