"""`kiln recipe migrate` on a recipe already in kiln's schema: each key the schema retired (RETIRED_KEYS in
kiln.recipe.schema) rewritten as the key that replaced it, in place, so the file's comments, key order and flow
style stay as written.

`graph.piecewise` becomes `graph.mode`: a `graph.mode` already given is kept (the old schema let it win), else
`piecewise: true` is `full_and_piecewise` and `piecewise: false` is `full` (the forward as one graph), what the old
schema read them as.
"""

from __future__ import annotations

from ruamel.yaml.comments import CommentedMap

from kiln.graph_mode import DEFAULT_GRAPH_MODE, GraphMode
from kiln.recipe.migrate_carry import Note

MODE_OF_PIECEWISE = {True: DEFAULT_GRAPH_MODE, False: GraphMode.FULL}


def is_kiln_recipe(root: CommentedMap) -> bool:
    """The document is in kiln's schema already (community recipes carry no recipe_version)."""
    return "recipe_version" in root


def retire_keys(root: CommentedMap) -> list[Note]:
    """Rewrite `root`'s retired keys in place; a note for each rewrite, at the key rewritten."""
    graph = root.get("graph")
    if not isinstance(graph, CommentedMap) or "piecewise" not in graph:
        return []
    line, col = graph.lc.key("piecewise")
    piecewise = graph["piecewise"]
    position = list(graph).index("piecewise")
    comment = graph.ca.items.pop("piecewise", None)
    del graph["piecewise"]
    if "mode" in graph:
        return [Note(line + 1, col + 1, f"graph.piecewise dropped: graph.mode {graph['mode']} says which graphs run")]
    mode = MODE_OF_PIECEWISE.get(piecewise) if isinstance(piecewise, bool) else None
    if mode is None:
        graph.insert(position, "mode", DEFAULT_GRAPH_MODE.value)
        message = f"graph.piecewise {piecewise!r} is not true or false: graph.mode set to kiln's default"
    else:
        graph.insert(position, "mode", mode.value)
        message = f"graph.piecewise: {str(piecewise).lower()} rewritten as graph.mode: {mode}"
    if comment is not None:
        graph.ca.items["mode"] = comment
    return [Note(line + 1, col + 1, message)]
