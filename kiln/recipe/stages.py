"""Pipeline stages: which decoder layers each stage holds, as `parallel` and `device_affinity` say, and the checks
that make that placement one the engine can run.

In kiln a `device_affinity` entry is one pipeline stage (`device_id` is the stage's index; with parallel.tensor N
the stage spans N devices). Stages run in device_id order, each on a contiguous run of layers, so the placement
is a partition of the layers into consecutive ranges, in increasing order.
"""

from __future__ import annotations

import re

from kiln.recipe.diagnostics import Diagnostic
from kiln.recipe.schema import RecipeSpec
from kiln.recipe.source import SourceDoc

# NOTE: no leading zeros, so each layer has exactly one spelling and "placed twice" cannot hide behind a second.
LAYER_GROUP = re.compile(r"decoder_layer_(0|[1-9][0-9]*)")
GROUP_FORM = "decoder_layer_<i>"
AFFINITY = ("device_affinity",)
StageLayers = tuple[tuple[int, ...], ...]


def layer_of(group: str) -> int | None:
    """The layer index a kernel group names (decoder_layer_7 -> 7); None for any other name."""
    match = LAYER_GROUP.fullmatch(group)
    return int(match.group(1)) if match else None


def pipeline_size(spec: RecipeSpec) -> int:
    """parallel.pipeline, or the number of device_affinity entries when it is not written (1 without either)."""
    if spec.parallel.pipeline is not None:
        return spec.parallel.pipeline
    return len(spec.device_affinity) if spec.device_affinity else 1


def stage_layers_of(spec: RecipeSpec) -> StageLayers | None:
    """Each stage's layers, ascending, stages in device_id order; None without device_affinity. Meaningful for a
    validated spec only (check_parallel refuses names that are no layer)."""
    if spec.device_affinity is None:
        return None
    entries = sorted(spec.device_affinity, key=lambda e: e.device_id)
    return tuple(tuple(sorted(i for g in e.kernel_groups if (i := layer_of(g)) is not None)) for e in entries)


def check_parallel(doc: SourceDoc, spec: RecipeSpec, num_layers: int | None) -> list[Diagnostic]:
    """Errors for a placement the engine cannot run; `num_layers` (None: the model is unknown) bounds the layers
    and makes every layer's placement checkable."""
    pipeline = pipeline_size(spec)
    if spec.device_affinity is None:
        if num_layers is not None and pipeline > num_layers:
            message = f"parallel.pipeline {pipeline} is more stages than the model's {num_layers} decoder layers"
            return [doc.diagnostic("error", message, ("parallel", "pipeline"))]
        return []
    if not spec.device_affinity:
        message = "device_affinity is empty: list one entry per pipeline stage, or remove it to split layers evenly"
        return [doc.diagnostic("error", message, AFFINITY)]
    device_errors = _check_device_ids(doc, spec, pipeline)
    placed, layer_errors = _check_groups(doc, spec, num_layers)
    out = device_errors + layer_errors
    if num_layers is not None:
        out += _check_missing(doc, placed, num_layers)
    # NOTE: stage order means something only once every id and name is sound (an empty stage is a layer error).
    if not device_errors and not layer_errors:
        out += _check_order(doc, spec)
    return out


def _check_device_ids(doc: SourceDoc, spec: RecipeSpec, pipeline: int) -> list[Diagnostic]:
    """Every device_id in [0, pipeline), each once, and (with parallel.pipeline written) every stage listed."""
    written = ("parallel", "pipeline") in doc.values
    why = (
        f"parallel.pipeline is {pipeline} (line {doc.position(('parallel', 'pipeline'))[0]})"
        if written
        else f"pipeline = the {pipeline} device_affinity entries"
    )
    tensor = spec.parallel.tensor
    spans = f"; with parallel.tensor {tensor} each stage spans {tensor} devices" if tensor > 1 else ""
    out: list[Diagnostic] = []
    seen: dict[int, int] = {}
    for i, entry in enumerate(spec.device_affinity or []):
        path = (*AFFINITY, i, "device_id")
        device = entry.device_id
        if not 0 <= device < pipeline:
            message = (
                f"device_id {device} is outside [0, {pipeline}): {why}, and each device_affinity entry is one "
                f"pipeline stage, numbered from 0{spans}"
            )
            out.append(doc.diagnostic("error", message, path))
        elif device in seen:
            message = f"device_id {device} is listed twice (also on line {doc.position((*AFFINITY, seen[device]))[0]})"
            out.append(doc.diagnostic("error", message, path))
        seen.setdefault(device, i)
    absent = [d for d in range(pipeline) if d not in seen]
    if written and absent and not out:
        message = (
            f"parallel.pipeline is {pipeline} but device_affinity has no entry for device_id "
            f"{', '.join(map(str, absent))}: list one entry per stage"
        )
        out.append(doc.diagnostic("error", message, AFFINITY, key=True))
    return out


def _check_groups(
    doc: SourceDoc, spec: RecipeSpec, num_layers: int | None
) -> tuple[dict[int, tuple[int, int]], list[Diagnostic]]:
    """Each kernel group names a layer of the model, placed once; returns layer -> (entry, item) of its placement."""
    expected = f"{GROUP_FORM} with i in [0, {num_layers})" if num_layers is not None else f"{GROUP_FORM}"
    out: list[Diagnostic] = []
    placed: dict[int, tuple[int, int]] = {}
    for i, entry in enumerate(spec.device_affinity or []):
        if not entry.kernel_groups:
            message = f"device {entry.device_id} holds no layers (kernel_groups is empty): every stage needs one"
            out.append(doc.diagnostic("error", message, (*AFFINITY, i, "kernel_groups")))
        for j, group in enumerate(entry.kernel_groups):
            path = (*AFFINITY, i, "kernel_groups", j)
            layer = layer_of(group)
            if layer is None:
                message = f"unknown kernel group {group!r}: expected {expected} (a stage holds whole decoder layers)"
                out.append(_whole(doc, message, path, group))
            elif num_layers is not None and layer >= num_layers:
                message = (
                    f"kernel group {group!r} is out of range: the model has {num_layers} decoder layers "
                    f"(decoder_layer_0 .. decoder_layer_{num_layers - 1})"
                )
                out.append(_whole(doc, message, path, group))
            elif layer in placed:
                first_entry, first_item = placed[layer]
                first = doc.position((*AFFINITY, first_entry, "kernel_groups", first_item))[0]
                message = f"{group} is placed twice (also on line {first}): each layer runs in one stage"
                out.append(_whole(doc, message, path, group))
            else:
                placed[layer] = (i, j)
    return placed, out


def _check_missing(doc: SourceDoc, placed: dict[int, tuple[int, int]], num_layers: int) -> list[Diagnostic]:
    missing = [i for i in range(num_layers) if i not in placed]
    if not missing:
        return []
    names = ", ".join(_span(run) for run in _runs(missing))
    message = (
        f"{names} {'is' if len(missing) == 1 else 'are'} placed on no device: each of the model's {num_layers} "
        "decoder layers must be in one stage's kernel_groups"
    )
    return [doc.diagnostic("error", message, AFFINITY, key=True)]


def _check_order(doc: SourceDoc, spec: RecipeSpec) -> list[Diagnostic]:
    """Each stage holds consecutive layers, and the stages follow the layers in device_id order."""
    out: list[Diagnostic] = []
    entries = sorted(enumerate(spec.device_affinity or []), key=lambda pair: pair[1].device_id)
    previous: tuple[int, list[int]] | None = None
    for i, entry in entries:
        written = [layer for g in entry.kernel_groups if (layer := layer_of(g)) is not None]
        layers = sorted(written)
        gap = next((k for k in range(1, len(layers)) if layers[k] != layers[k - 1] + 1), None)
        if gap is not None:
            j = written.index(layers[gap])
            message = (
                f"device {entry.device_id}'s layers are not consecutive: decoder_layer_{layers[gap]} follows "
                f"decoder_layer_{layers[gap - 1]}; a pipeline stage runs one contiguous run of layers"
            )
            out.append(_whole(doc, message, (*AFFINITY, i, "kernel_groups", j), entry.kernel_groups[j]))
        elif previous is not None and layers[0] < previous[1][-1]:
            before = previous[1]
            message = (
                f"device {entry.device_id} holds {_span(layers)} but device {previous[0]} holds {_span(before)}: "
                f"stages run in device_id order, so device {entry.device_id}'s layers must come after "
                f"device {previous[0]}'s"
            )
            out.append(doc.diagnostic("error", message, (*AFFINITY, i, "device_id")))
        previous = (entry.device_id, layers)
    return out


def _whole(doc: SourceDoc, message: str, path: tuple, text: str) -> Diagnostic:
    """An error that underlines the whole kernel-group name."""
    line, col = doc.position(path)
    source = doc.source_line(line) or ""
    length = len(text) + 2 if source[col - 1 : col] in ("'", '"') else len(text)
    return doc.at("error", message, line=line, col=col, length=length)


def _runs(layers: list[int]) -> list[list[int]]:
    """Ascending layers grouped into runs of consecutive ones."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _span(layers: list[int]) -> str:
    """decoder_layer_3 for one layer, decoder_layer_3..decoder_layer_7 for a run (first to last)."""
    first = f"decoder_layer_{layers[0]}"
    return first if len(layers) == 1 else f"{first}..decoder_layer_{layers[-1]}"
