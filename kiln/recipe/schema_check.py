"""Schema validation with diagnostics for people: the key's line and column, and "did you mean" for near misses."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from kiln.recipe.diagnostics import Diagnostic, RecipeError
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.source import KeyPath, SourceDoc


def validate_schema(doc: SourceDoc) -> RecipeSpec:
    """The recipe as a RecipeSpec, or RecipeError with one diagnostic per problem."""
    try:
        return RecipeSpec.model_validate(doc.data)
    except ValidationError as exc:
        # NOTE: a union (`str | int`) fails once per branch; group those into one "expected a or b" diagnostic.
        grouped: dict[tuple[KeyPath, str], list[dict]] = {}
        for err in exc.errors(include_url=False):
            path = _data_path(doc.data, err["loc"])
            kind = err["type"] if err["type"] in ("extra_forbidden", "missing") else "value"
            grouped.setdefault((path, kind), []).append({**err, "loc": path})
        raise RecipeError([_diagnostic(doc, errs) for errs in grouped.values()]) from None


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
        allowed = sorted(_fields_at(path[:-1]))
        section = dotted(path[:-1]) if path[:-1] else "the top level"
        message = f"unknown key {key!r} in {section}{did_you_mean(key, allowed)}"
        if allowed:
            message += f" (expected one of: {', '.join(allowed)})"
        return doc.diagnostic("error", message, path, key=True)
    if err["type"] == "missing":
        parent = dotted(path[:-1]) if path[:-1] else "the top level"
        return doc.diagnostic("error", f"missing required key {str(path[-1])!r} in {parent}", path[:-1], key=True)
    found = _short(err.get("input"))
    if err["type"] == "literal_error":
        hint = did_you_mean(err["input"], _literals_at(path)) if isinstance(err.get("input"), str) else ""
        return doc.diagnostic("error", f"{where}: expected {err['ctx']['expected']}, got {found}{hint}", path)
    expected = [_EXPECTED[e["type"]] for e in errors if e["type"] in _EXPECTED]
    if len(expected) == len(errors):
        reason = "expected " + " or ".join(dict.fromkeys(expected))
    else:
        reason = " or ".join(dict.fromkeys(_lower_first(e["msg"]) for e in errors))
    return doc.diagnostic("error", f"{where}: {reason}, got {found}", path)


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
    cls: Any = RecipeSpec
    annotation: Any = None
    for part in path:
        if isinstance(part, int):
            continue
        model = _inner_model(cls) if cls is not None else None
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        cls = annotation
    return annotation


def _fields_at(path: KeyPath) -> list[str]:
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
