"""`kiln recipe migrate`: a recipe in kiln's schema with its retired keys rewritten (kiln.recipe.migrate_retired),
or a recipe in the community shape (`model_name`, `hardware_preference`, per-tensor
`constraints`, ...) rewritten in kiln's schema. Values and their comments are carried by the table in
kiln.recipe.community (kiln.recipe.migrate_carry); what the community shape does not say and kiln needs (the
device, the checkpoint's storage type, graph settings) is filled in here, each with a comment saying so."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import CommentMark
from ruamel.yaml.tokens import CommentToken

from kiln.errors import KilnError
from kiln.recipe.checkpoint import QUANTIZED, layer_storage_type, read_header
from kiln.recipe.evaluate import evaluate
from kiln.recipe.expr import ExprError, parse_constraint
from kiln.recipe.migrate_carry import Carrier, Note, Where, like
from kiln.recipe.migrate_retired import is_kiln_recipe, retire_keys
from kiln.recipe.schema import Graph
from kiln.recipe.schema_check import fields_at
from kiln.recipe.source import KeyPath, load_mapping, source_doc

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
MAX_CAPTURE_SIZE = 4096
FILLED = "kiln recipe migrate"
KEEP_LINES = 1 << 16  # a line width no recipe reaches


@dataclass(frozen=True)
class Migration:
    """The kiln recipe text, and a note for each field not carried, in input order."""

    text: str
    notes: list[Note]


def migrate_text(text: str, file: str = "<string>", out: str | None = None) -> Migration:
    """Rewrite a kiln recipe's retired keys, or convert community-shaped recipe text; `file` is where it was read
    and `out` where it will be written (for relative model paths). RecipeError when the text is not a YAML mapping
    with names as keys."""
    root = load_mapping(text, file)
    source_doc(root, text, file)  # NOTE: the refusals validate makes too: keys that are not names, alias bombs
    if is_kiln_recipe(root):
        notes = retire_keys(root)
        # NOTE: lines are kept as long as written: a rewrite must not reflow the rest of the file
        return Migration(_dump(root, width=KEEP_LINES) if notes else text, notes)
    carrier = Carrier()
    carrier.carry_section((), root)
    _fill(carrier, file, out)
    tree = _ordered(carrier.tree, ())
    _set_header(tree, root, file)
    return Migration(_dump(tree), sorted(carrier.notes, key=lambda n: (n.line, n.col)))


def _fill(carrier: Carrier, file: str, out: str | None) -> None:
    """What kiln needs and the community shape does not say, in the order these values depend on each other."""
    carrier.tree.setdefault("recipe_version", 1)
    _fill_device(carrier)
    _fill_weights(carrier, file)  # NOTE: reads the checkpoint, so before model.path is made relative to `out`
    model = carrier.tree.get("model")
    if not isinstance(model, CommentedMap) or "name" not in model:
        carrier.note((1, 1), "model.name not set: the input has no model_name; add model.name")
    if isinstance(model, CommentedMap) and isinstance(model.get("path"), str):
        model["path"] = _relative_to(model["path"], file, out)
    _fill_graph(carrier.tree)
    for where, group in carrier.quantized_groups:
        _decide_quantized(carrier, where, group)


def _set_header(tree: CommentedMap, root: CommentedMap, file: str) -> None:
    """The input's header comment, under a line saying where the recipe came from (once, however often migrated)."""
    header = list(root.ca.comment[1] or []) if root.ca.comment else []
    if not any(f"by `{FILLED}`" in token.value for token in header):
        tree.yaml_set_start_comment(f"Migrated to kiln's schema by `{FILLED}` from {os.path.basename(file)}.")
    if header:
        tree.ca.comment = tree.ca.comment or [None, []]
        tree.ca.comment[1] = (tree.ca.comment[1] or []) + header


def _fill_device(carrier: Carrier) -> None:
    """kiln needs hardware.device: `cuda` when the input names a GPU arch, else `cpu`; `cuda:1` loses its index."""
    hardware = carrier.tree.setdefault("hardware", CommentedMap())
    if not isinstance(hardware, CommentedMap):
        return
    device = hardware.get("device")
    if isinstance(device, str) and device.startswith("cuda:"):
        hardware["device"] = "cuda"
        where = carrier.set_at.get("hardware.device", (1, 1))
        carrier.note(
            where,
            f"device index {device!r} not carried: hardware.device names the kind of device; kiln numbers the ones "
            "it runs on from 0 (see device_affinity, parallel): pick them with CUDA_VISIBLE_DEVICES",
        )
    elif "device" not in hardware:
        arch = hardware.get("arch")
        gpu = isinstance(arch, str) and arch.startswith("sm_")
        hardware["device"] = "cuda" if gpu else "cpu"
        why = f"the input asks for GPU arch {arch}" if gpu else "the input names no device"
        _note_after(hardware, "device", f"set by {FILLED}: {why}")


def _fill_weights(carrier: Carrier, file: str) -> None:
    """weights: the dtype of hidden_states (kiln runs the model in weights.dtype), and what the checkpoint holds."""
    tree = carrier.tree
    if "weights" in tree:
        return
    dtype = _get(tree, "input_constraints", "hidden_states", "dtype")
    weights = CommentedMap(dtype=dtype if dtype in FLOAT_DTYPES else "float32")
    weights.fa.set_flow_style()
    model = tree.get("model")
    path = model.get("path", "default") if isinstance(model, CommentedMap) else "default"
    try:
        header = read_header(_beside(path, file) if isinstance(path, str) else "default")
    except (KilnError, OSError) as exc:
        where = carrier.set_at.get("model.path", (1, 1))
        carrier.note(where, f"weights.source_quantization not set: cannot read the checkpoint: {exc}")
        tree["weights"] = weights
        return
    stored = layer_storage_type(header)
    weights["source_quantization"] = QUANTIZED.get(stored, "none")
    tree["weights"] = weights
    source = "the dtype of hidden_states" if dtype in FLOAT_DTYPES else "kiln's default dtype"
    _note_before(tree, "weights", f"weights: set by {FILLED} ({source}; the checkpoint stores {stored})")


def _fill_graph(tree: CommentedMap) -> None:
    """kiln's graph defaults, with the capture sizes that the constraints over num_tokens alone allow."""
    if "graph" in tree:
        return
    constraints = _get(tree, "input_constraints", "constraints")
    graph = CommentedMap(Graph().model_dump(exclude_none=True))
    graph["capture_sizes"] = _capture_sizes(graph["capture_sizes"], constraints)
    graph.fa.set_flow_style()
    tree["graph"] = graph
    _note_before(
        tree, "graph", f"graph: set by {FILLED} (kiln's defaults; the capture sizes the num_tokens constraints allow)"
    )


def _capture_sizes(defaults: list[int], constraints: object) -> list[int]:
    """The default sizes the constraints allow; failing that, the first as many powers of two that they do."""
    checks = []
    for text in constraints if isinstance(constraints, list) else []:
        try:
            expr = parse_constraint(text) if isinstance(text, str) else None
        except ExprError:
            continue
        if expr is not None and expr.symbols == {"num_tokens"}:
            checks.append(expr)

    def allowed(size: int) -> bool:
        try:
            return all(evaluate(expr, {"num_tokens": size}) for expr in checks)
        except ExprError:
            return False

    sizes = [s for s in defaults if allowed(s)]
    if not sizes:
        powers = (1 << i for i in range(MAX_CAPTURE_SIZE.bit_length()))
        sizes = [s for s in powers if allowed(s)][: len(defaults)]
    return sizes or defaults


def _decide_quantized(carrier: Carrier, where: Where, group: str) -> None:
    """all_ops_quantized becomes the group's claim of the recipe's weight scheme (checked on the loaded model)."""
    quantization = carrier.tree.get("quantization")
    weights = quantization.get("weights") if isinstance(quantization, CommentedMap) else None
    if weights in (None, "none"):
        message = (
            f"all_ops_quantized not carried (group {group}): quantization.weights is not set, so the group's "
            "weights run unquantized"
        )
        carrier.note(where, message)
        return
    for entry in carrier.tree.get("fusion_groups") or []:
        if isinstance(entry, CommentedMap) and entry.get("name") == group:
            entry["all_ops_quantized"] = weights


def _relative_to(path: str, file: str, out: str | None) -> str:
    """A model path relative to the input file, made relative to the output file."""
    if out is None or path in ("", "default") or os.path.isabs(path):
        return path
    return os.path.relpath(_beside(path, file), os.path.dirname(os.path.abspath(out)))


def _beside(path: str, file: str) -> str:
    """A model path relative to the input file, as a path that opens from here."""
    if path in ("", "default") or os.path.isabs(path) or file == "<string>":
        return path
    return os.path.join(os.path.dirname(file), path)


def _get(node: object, *keys: str) -> object:
    """node[k1][k2]... where each step is a mapping holding the key; None otherwise."""
    for key in keys:
        if not isinstance(node, CommentedMap) or key not in node:
            return None
        node = node[key]
    return node


def _note_before(tree: CommentedMap, key: str, text: str) -> None:
    """A comment line above a top-level key."""
    tree.yaml_set_comment_before_after_key(key, before=text, indent=0)


def _note_after(node: CommentedMap, key: str, text: str) -> None:
    """An end-of-line comment on a block mapping's key that has none."""
    if not node.fa.flow_style() and key not in node.ca.items:
        node.ca.items[key] = [None, None, CommentToken(f" # {text}\n", CommentMark(0)), None]


def _ordered(node: CommentedMap, path: KeyPath) -> CommentedMap:
    """`node` with its keys in schema order, recursively; comments and flow style kept."""
    fields = fields_at(path)
    out = like(node)
    out.ca.comment = node.ca.comment
    for key in sorted(node, key=lambda k: fields.index(k) if k in fields else len(fields)):
        value, child = node[key], (*path, key)
        out[key] = _ordered(value, child) if isinstance(value, CommentedMap) and fields_at(child) else value
        if key in node.ca.items:
            out.ca.items[key] = node.ca.items[key]
    return out


def _dump(tree: CommentedMap, width: int = 120) -> str:
    yaml = YAML(typ="rt")
    yaml.width = width
    yaml.indent(mapping=2, sequence=4, offset=2)
    stream = io.StringIO()
    yaml.dump(tree, stream)
    return stream.getvalue()
