"""The package's shape: no import circles, imports at module top (except the listed lazy ones), a fast `--help`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KILN = Path(__file__).resolve().parents[2] / "kiln"

# Imports inside functions, each for a measured reason; a new one must be added here with its reason.
LAZY_IMPORTS = {
    ("kiln/bench/vllm_worker.py", "vllm"): "the worker runs in vLLM's own environment; kiln's has no vllm",
    ("kiln/bench/vllm_runner.py", "transformers"): "optional ([hf] extra): only to dequantize a GGUF for vLLM",
    ("kiln/__init__.py", "importlib"): "public API loads on first use: `import kiln` stays light",
    (
        "kiln/engine/setup/resolve.py",
        "kiln.recipe",
    ): "pydantic + z3 only when --recipe is given (kiln --help builds EngineArgs)",
    ("kiln/engine/setup/resolve.py", "kiln.engine.setup.recipe_config"): "same: the recipe overlay imports kiln.recipe",
    ("kiln/compile/compiler.py", "torch._inductor"): "importing inductor takes ~1 s; eager engines never need it",
    ("kiln/compile/compiler.py", "torch._inductor.codecache"): "same",
    ("kiln/platforms.py", "torch._inductor"): "same: only a compile-cache key of a CPU piece names inductor's ISA",
    ("kiln/kernels/native/build.py", "torch.utils"): "cpp_extension imports setuptools; only a first build needs it",
    ("kiln/bench/hf_runner.py", "transformers"): "optional dependency (the hf extra), for --compare hf",
    ("kiln/bench/llamacpp_runner.py", "llama_cpp"): "optional dependency (the llamacpp extra), for --compare llama.cpp",
    ("kiln/bench/loadtest_report.py", "matplotlib"): "optional dependency (the dev extra), for --plot",
    ("kiln/bench/loadtest_report.py", "matplotlib.pyplot"): "same",
    (
        "kiln/engine/structured/grammar_build.py",
        "llguidance",
    ): "only a constrained request needs it (a GPU box may lack it)",
    ("kiln/engine/structured/grammar_build.py", "llguidance.gbnf_to_lark"): "same",
    ("kiln/engine/serving/commands.py", "kiln.engine.serving.llm"): "torch and inductor (~7 s) load once the flags, "
    "the sampling parameters and the model's path are checked: a bad one is reported at once",
    ("kiln/engine/serving/commands.py", "kiln.compile.artifacts"): "same, for `kiln compile`",
    ("kiln/engine/serving/commands.py", "kiln.compile.diagnose"): "same",
    ("kiln/engine/serving/commands.py", "kiln.engine.setup.build"): "same",
    ("kiln/engine/serving/commands.py", "kiln.executor.graph"): "same",
    ("kiln/model/loader/hf_quant.py", "kiln.quant.compressed"): "compressed-tensors imports transformers (~3 s): "
    "only a compressed-tensors checkpoint pays it",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in KILN.rglob("*.py"):
        parts = list(path.relative_to(KILN.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _module_edges() -> dict[str, set[str]]:
    """Each kiln module -> the kiln modules it imports (TYPE_CHECKING imports included)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node: every circle of the graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles() -> None:
    assert _circles(_module_edges()) == []


# packages whose subpackages are packages of their own (rooms): `kiln.engine.scheduling.scheduler` ->
# `kiln.engine.scheduling`, and a module at the room's top (`kiln.engine.core`) is a package of its own
ROOMED = ("kiln.engine",)


def _package(module: str) -> str:
    """`kiln.compile.store` -> `kiln.compile`; a top-level module (`kiln.config`) is a package of its own."""
    parts = module.split(".")
    depth = 3 if ".".join(parts[:2]) in ROOMED and len(parts) > 2 else 2
    return ".".join(parts[:depth])


def test_no_two_packages_import_each_other() -> None:
    """Packages layer (cli -> server/bench/debug -> engine -> executor -> kernels -> compile -> model -> quant ->
    config): a circle between packages, even one no module-level circle shows, is a joint to untangle."""
    packages: dict[str, set[str]] = {}
    for module, targets in _module_edges().items():
        if module == "kiln":  # the package's own __init__ re-exports the public API
            continue
        source = packages.setdefault(_package(module), set())
        source.update(p for t in targets if (p := _package(t)) != _package(module) and p != "kiln")
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    assert _circles(packages) == []


def test_imports_sit_at_module_top() -> None:
    found = {}
    for path in _modules().values():
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        guarded = {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node) for n in node.body
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level | guarded:
                rel = str(path.relative_to(KILN.parent))
                module = node.names[0].name if isinstance(node, ast.Import) else node.module
                found[(rel, module)] = node.lineno
    unexplained = sorted(set(found) - set(LAZY_IMPORTS))
    assert unexplained == [], "imports inside functions need a reason in LAZY_IMPORTS"
    stale = sorted(set(LAZY_IMPORTS) - set(found))
    assert stale == [], "LAZY_IMPORTS lists imports that no longer exist"


def test_every_module_says_what_it_owns() -> None:
    missing = [name for name, path in _modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


def test_help_builds_every_parser_without_torch() -> None:
    code = (
        "import sys, kiln.cli, kiln.launch; kiln.cli.build_parser(); kiln.launch.build_parser(); "
        "print(sorted(m for m in ('torch', 'pydantic', 'z3', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout and "debug" in proc.stdout


def test_every_package_docstring_maps_its_modules() -> None:
    """A package's docstring is its map: each module of the package is named there (`name.py`)."""
    unnamed = []
    for init in KILN.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for module in sorted(init.parent.glob("*.py")):
            if module.name != "__init__.py" and module.name not in doc and init.parent != KILN:
                unnamed.append(str(module.relative_to(KILN.parent)))
    assert unnamed == []


def _engine_rooms() -> list[str]:
    """The engine's rooms and root modules, top first, as kiln/engine/__init__.py lists them."""
    doc = ast.get_docstring(ast.parse((KILN / "engine" / "__init__.py").read_text())) or ""
    names = [line.split()[0] for line in doc.splitlines() if line and line.split()[0].endswith(("/", ".py"))]
    return ["kiln.engine." + name.removesuffix("/").removesuffix(".py") for name in names]


def test_the_engine_is_rooms_and_arrows_point_down_its_map() -> None:
    """engine/ is rooms by role (no flat room of modules): at most three modules at its root, every room listed in
    the package map, and a room imports only rooms listed below it."""
    engine = KILN / "engine"
    root_modules = sorted(p.name for p in engine.glob("*.py") if p.name != "__init__.py")
    assert len(root_modules) <= 3, root_modules
    order = _engine_rooms()
    rooms = {f"kiln.engine.{p.name}" for p in engine.iterdir() if (p / "__init__.py").exists()}
    assert rooms | {f"kiln.engine.{m.removesuffix('.py')}" for m in root_modules} == set(order)
    upward = sorted(
        (_package(module), _package(target))
        for module, targets in _module_edges().items()
        if _package(module) in order
        for target in targets
        if _package(target) in order and order.index(_package(target)) < order.index(_package(module))
    )
    assert upward == [], "an engine room imports a room listed above it in kiln/engine/__init__.py"


def test_the_scheduler_imports_no_model_and_no_tensors() -> None:
    """Scheduling is plain data: its room imports no room that runs a model or proposes drafts, and none of its
    modules but admission (which seeds a request's torch.Generator) imports torch."""
    edges = _module_edges()
    scheduling = [m for m in edges if m.startswith("kiln.engine.scheduling.")]
    imported = {t for m in scheduling for t in edges[m]}
    forbidden = ["kiln.engine.speculation", "kiln.engine.running", "kiln.engine.loop", "kiln.engine.core"]
    forbidden += ["kiln.engine.output", "kiln.executor", "kiln.compile", "kiln.kernels"]
    assert sorted(t for t in imported if any(t == f or t.startswith(f + ".") for f in forbidden)) == []
    with_torch = []
    for module in scheduling:
        tree = ast.parse(_modules()[module].read_text())
        if "torch" in {name.split(".")[0] for node in ast.walk(tree) for name in _imported(node)}:
            with_torch.append(module)
    assert with_torch == ["kiln.engine.scheduling.admission"]
