"""The carrying half of `kiln recipe migrate`: walks a community-shaped mapping and writes each value where
kiln.recipe.community says kiln keeps it, comments included, or notes why it stays behind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.tokens import CommentToken

from kiln.recipe.community import SECTIONS, SECTIONS_WHEN_MAPPING, TENSORS, community_key
from kiln.recipe.schema_check import did_you_mean, dotted, fields_at
from kiln.recipe.sections import INPUTS
from kiln.recipe.source import KeyPath

CONSTRAINTS = "input_constraints.constraints"
Where = tuple[int, int]  # 1-based (line, col) in the input


@dataclass(frozen=True)
class Note:
    """Something migrate did not carry (or had to change): where it is in the input and why."""

    line: int
    col: int
    message: str

    def format(self, file: str) -> str:
        return f"{file}:{self.line}:{self.col}: note: {self.message}"


class Carrier:
    """Builds the kiln tree. `set_at` maps each dotted kiln path written to where its value came from;
    `quantized_groups` holds the `all_ops_quantized` conditions, decided once quantization is known."""

    def __init__(self) -> None:
        self.tree = CommentedMap()
        self.notes: list[Note] = []
        self.set_at: dict[str, Where] = {}
        self.quantized_groups: list[tuple[Where, str]] = []

    def note(self, where: Where, message: str) -> None:
        self.notes.append(Note(where[0], where[1], message))

    def carry_section(self, kiln: KeyPath, node: CommentedMap) -> None:
        """Carry a mapping that belongs at the kiln section `kiln` (() is the top level), key by key."""
        fields = fields_at(kiln)
        for key in node:
            entry = community_key(kiln, key)
            if entry is not None and entry.kiln is None:
                self.note(position(node, key), f"{key} not carried: {entry.why}")
            elif not kiln and key in SECTIONS:
                self.carry_community_section(node, key, SECTIONS[key])
            elif not kiln and key in SECTIONS_WHEN_MAPPING and isinstance(node[key], CommentedMap):
                self.carry_community_section(node, key, SECTIONS_WHEN_MAPPING[key])
            elif entry is not None and entry.kiln == "recipe_version":
                self.put("recipe_version", 1, node, key)
                if str(node[key]) not in ("1", "1.0"):
                    message = f"{key} {node[key]!r} not carried: kiln writes recipe_version 1, its schema's version"
                    self.note(position(node, key), message)
            elif entry is not None and entry.kiln is not None:
                self.put(entry.kiln, node[key], node, key)
            elif kiln == ("input_constraints",) and key not in fields:
                self.carry_tensor(node, key, supported=False)
            elif key in fields:
                self.carry_field((*kiln, key), node, key)
            else:
                where = f"in {dotted(kiln)}" if kiln else "at the top level"
                message = f"{key} not carried: kiln has no {key!r} {where}{did_you_mean(key, fields)}"
                self.note(position(node, key), message)

    def carry_field(self, path: KeyPath, node: CommentedMap, key: str) -> None:
        value = node[key]
        if path == ("fusion_groups",) and isinstance(value, list):
            self.put("fusion_groups", self.fusion_groups(value), node, key)
        elif path[0] == "input_constraints" and path[-1] in TENSORS:
            self.carry_tensor(node, key, supported=True)
        elif fields_at(path) and isinstance(value, CommentedMap):
            if self.section(path, value, node, key):
                self.carry_section(path, value)
        else:
            self.put(dotted(path), value, node, key)

    def carry_community_section(self, node: CommentedMap, key: str, kiln: str) -> None:
        value = node[key]
        if not isinstance(value, CommentedMap):
            self.note(position(node, key), f"{key} not carried: expected a mapping, found {value!r}")
        elif self.section((kiln,), None, node, key):
            self.carry_section((kiln,), value)

    def carry_tensor(self, node: CommentedMap, key: str, supported: bool) -> None:
        """A tensor spec: its shape and dtype where kiln has the tensor with that rank; its constraints always."""
        spec = node[key]
        dims = INPUTS[key][0] if supported else ()
        shape = spec.get("shape") if isinstance(spec, CommentedMap) else None
        if supported and (not isinstance(shape, list) or len(shape) == len(dims)):
            path = ("input_constraints", key)
            if not isinstance(spec, CommentedMap):
                self.put(dotted(path), spec, node, key)
            elif self.section(path, spec, node, key):
                self.carry_section(path, spec)
            return
        if supported:
            reason = f"kiln's {key} is [{', '.join(dims)}], not [{', '.join(map(str, shape or ()))}]"
        else:
            reason = f"kiln declares {', '.join(TENSORS)} only"
        has_constraints = isinstance(spec, CommentedMap) and "constraints" in spec
        carried = "; its constraints are carried" if has_constraints else ""
        self.note(position(node, key), f"{key} not carried: {reason}{carried}")
        if has_constraints:
            self.put(CONSTRAINTS, spec["constraints"], spec, "constraints")

    def fusion_groups(self, groups: list) -> CommentedSeq:
        """Each group's kiln keys (name, ops, required); the rest are notes."""
        out = CommentedSeq()
        for i, group in enumerate(groups):
            if isinstance(group, CommentedMap):
                kept = like(group)
                for key in group:
                    self.group_key(group, key, kept, str(group.get("name", i)))
                group = kept
            out.append(group)
            move_comment(groups, i, out, i)
        return out

    def group_key(self, group: CommentedMap, key: str, kept: CommentedMap, name: str) -> None:
        if key in fields_at(("fusion_groups", 0)):
            kept[key] = group[key]
            move_comment(group, key, kept, key)
        elif key == "constraint" and isinstance(group[key], CommentedMap):
            conditions = group[key]
            for condition in conditions:
                if condition == "all_ops_quantized":
                    self.quantized_groups.append((position(conditions, condition), name))
                else:
                    message = f"{condition} not carried: kiln fusion groups carry no conditions (group {name})"
                    self.note(position(conditions, condition), message)
        else:
            entry = community_key(("fusion_groups", 0), key)
            reason = entry.why if entry is not None else f"kiln fusion groups have no {key!r}"
            self.note(position(group, key), f"{key} not carried: {reason} (group {name})")

    def section(self, path: KeyPath, style: CommentedMap | None, node: CommentedMap, key: str) -> bool:
        """Make sure the kiln mapping at `path` exists (flow or block like `style`) and give it node[key]'s
        comments; False (with a note) where a non-mapping value already sits there."""
        parent = self.tree
        for part in path[:-1]:
            parent = parent.setdefault(part, CommentedMap())
        existing = parent.get(path[-1])
        if existing is not None and not isinstance(existing, CommentedMap):
            self.note(position(node, key), f"{key} not carried: {dotted(path)} is already set to {existing!r}")
            return False
        if existing is None:
            parent[path[-1]] = like(style) if style is not None else CommentedMap()
        target = parent[path[-1]]
        if style is not None and style.ca.comment and not target.ca.comment:
            target.ca.comment = style.ca.comment
        if path[-1] not in parent.ca.items:
            move_comment(node, key, parent, path[-1])
        return True

    def put(self, path: str, value: Any, node: CommentedMap, key: str) -> None:
        """Write `value` (from node[key]) at the dotted kiln `path`, comments too. The constraint lists of several
        tensors join into one; anything else written twice is a note."""
        where = position(node, key)
        parts = path.split(".")
        parent = self.tree
        for i, part in enumerate(parts[:-1]):
            child = parent.setdefault(part, CommentedMap())
            if not isinstance(child, CommentedMap):
                self.note(where, f"{key} not carried: {'.'.join(parts[: i + 1])} is already set to {child!r}")
                return
            parent = child
        last, existing = parts[-1], parent.get(parts[-1])
        if path == CONSTRAINTS and isinstance(existing, CommentedSeq) and isinstance(value, list):
            first = len(existing)
            for i, item in enumerate(value):
                existing.append(item)
                move_comment(value, i, existing, len(existing) - 1)
            key_comment = node.ca.items.get(key, [None] * 3)[2]
            if value and key_comment is not None and first not in existing.ca.items:
                # NOTE: the tensor's `constraints:` key is gone; its comment stays with the first of its items.
                text = key_comment.value.rstrip("\n") + "\n"
                existing.ca.items[first] = [_near(CommentToken(text, CommentMark(0))), None]
            return
        if last in parent:
            line = self.set_at.get(path, where)[0]
            self.note(where, f"{key} not carried: {path} is already set (line {line})")
            return
        parent[last] = block_seq(value) if path == CONSTRAINTS and isinstance(value, list) else value
        move_comment(node, key, parent, last)
        self.set_at[path] = where


def block_seq(items: list) -> CommentedSeq:
    """A block-style copy of a (maybe flow) list, item comments kept: the one constraint list, which grows."""
    out = CommentedSeq()
    for i, item in enumerate(items):
        out.append(item)
        move_comment(items, i, out, i)
    return out


def like(node: CommentedMap) -> CommentedMap:
    """An empty mapping in `node`'s style (flow `{...}` or block)."""
    new = CommentedMap()
    if node.fa.flow_style():
        new.fa.set_flow_style()
    return new


def move_comment(src: Any, key: Any, dst: Any, new_key: Any) -> None:
    """Copy the comments ruamel keeps on src[key] to dst[new_key]; an end-of-line comment then sits right after
    its value wherever that value lands, not at its old column."""
    items = getattr(getattr(src, "ca", None), "items", {})
    if key in items:
        dst.ca.items[new_key] = [_near(t) if isinstance(t, CommentToken) else t for t in items[key]]


def _near(token: CommentToken) -> CommentToken:
    return CommentToken(" " + token.value, CommentMark(0)) if token.value.startswith("#") else token


def position(node: CommentedMap, key: Any) -> Where:
    """Where `key` is written (its mapping's start for a merged key ruamel kept no position for)."""
    try:
        line, col = node.lc.key(key)
    except (KeyError, IndexError, TypeError):
        line, col = node.lc.line, node.lc.col
    return ((line or 0) + 1, (col or 0) + 1)
