"""The community recipe shape (`model_name`, `hardware_preference`, per-tensor `constraints`, ...): where each of
its keys lives in a kiln recipe, or why kiln has no place for it. `kiln recipe migrate` converts by this table;
schema validation quotes it for an unknown key."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.recipe.source import KeyPath

MIGRATE_HINT = "kiln recipe migrate converts community recipes"
TENSORS = ("input_ids", "positions", "hidden_states")


@dataclass(frozen=True)
class CommunityKey:
    """A community key: the dotted kiln path it moves to, or (`kiln` None) why kiln does not carry it."""

    kiln: str | None
    why: str = ""


def _to(path: str) -> CommunityKey:
    return CommunityKey(path)


def _dropped(why: str) -> CommunityKey:
    return CommunityKey(None, why)


# Community sections whose keys all move into one kiln section (looked up there in KEYS).
SECTIONS = {"hardware_preference": "hardware", "memory_pool_config": "hardware"}
# Top-level keys kiln has too, kept as they are when they are lists: device_affinity, one {device_id,
# kernel_groups} entry per pipeline stage. Written as a mapping of device settings (device, numa_node, device_ids),
# their keys move into the kiln section named here instead.
SECTIONS_WHEN_MAPPING = {"device_affinity": "hardware"}

# Where a key sits, as a kiln section ("" the top level, "[]" any list item) -> community key -> where it goes.
KEYS: dict[str, dict[str, CommunityKey]] = {
    "": {
        "model_name": _to("model.name"),
        "model_path": _to("model.path"),
        "layer_type": _to("model.layer_type"),
        "version": _to("recipe_version"),
        "debug_mode": _to("debug.debug_mode"),
    },
    "hardware": {
        "gpu_arch": _to("hardware.arch"),
        "pool_size_gb": _to("hardware.memory_budget_gb"),
        "memory_bandwidth_optimized": _dropped("kiln chooses kernels by timing them"),
        "power_limit_watts": _dropped("kiln does not manage device power"),
        "device_ids": _dropped(
            "kiln numbers the devices it runs on from 0 (device_affinity's device_id is a pipeline stage, "
            "parallel.tensor the devices per stage); choose the physical ones with CUDA_VISIBLE_DEVICES"
        ),
        "numa_node": _dropped("kiln does not pin memory or threads to a NUMA node"),
        "allocator": _dropped("kiln allocates through torch's caching allocator"),
        "enable_defragmentation": _dropped("the paged KV cache is one fixed pool of pages; nothing fragments"),
    },
    "quantization": {"scheme": _to("quantization.weights")},
    "fusion_groups[]": {
        "constraint": _dropped(
            "kiln fusion groups carry no conditions (all_ops_quantized becomes the group's all_ops_quantized: "
            "the recipe's weight scheme)"
        )
    },
    **{f"input_constraints.{name}": {"constraints": _to("input_constraints.constraints")} for name in TENSORS},
}


def section_name(path: KeyPath) -> str:
    """`fusion_groups[]` for ('fusion_groups', 0): a KEYS section."""
    return "".join("[]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def community_key(path: KeyPath, key: str) -> CommunityKey | None:
    """The table entry of `key` found under `path`; None when it is no known community key there."""
    if not path and key in SECTIONS:
        return _to(SECTIONS[key])
    return KEYS.get(section_name(path), {}).get(key)


def community_hint(path: KeyPath, key: str) -> str | None:
    """`kiln spells it model.name` for an unknown key that is a known community key under `path`, else None."""
    entry = community_key(path, key)
    if entry is None:
        return None
    if not path and key in SECTIONS:
        return f"kiln keeps these settings in {entry.kiln} ({MIGRATE_HINT})"
    if entry.kiln is None:
        return f"kiln has no such setting: {entry.why} ({MIGRATE_HINT})"
    return f"kiln spells it {entry.kiln} ({MIGRATE_HINT})"


def community_shape_hint(path: KeyPath, value: object) -> str | None:
    """For a kiln key written in its community mapping shape (`device_affinity: {device: cuda}`): where kiln keeps
    those settings. None otherwise."""
    if len(path) != 1 or path[0] not in SECTIONS_WHEN_MAPPING or not isinstance(value, dict):
        return None
    key = str(path[0])
    return (
        f"a mapping of device settings is the community shape of {key}: kiln keeps them in "
        f"{SECTIONS_WHEN_MAPPING[key]} ({MIGRATE_HINT}); kiln's {key} lists pipeline stages"
    )
