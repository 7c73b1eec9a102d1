"""The package's shape: imports point down only, every module imports in a fresh interpreter
without the CLI libraries, and no module shadows a standard-library name."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Layers, lowest first: a module may import modules of its own layer or of a lower one. The
# folders are the floors; the top level holds only the shared leaves and one module per command.
LAYERS = [
    ["xformer.errors", "xformer.files", "xformer.locks", "xformer.events", "xformer.metrics", "xformer.results",
     "xformer.allocator", "xformer.significance"],
    ["xformer.config"],
    ["xformer.model", "xformer.data"],
    ["xformer.training"],
    ["xformer.generation"],
    ["xformer.tasks"],
    ["xformer.heads"],
    ["xformer.train", "xformer.evaluate", "xformer.tokenizing", "xformer.check", "xformer.export",
     "xformer.importing"],
    ["xformer.studies", "xformer.bench"],
    ["xformer"],  # the package's __init__: the library's front door
]
# what may sit at the top of the package: the leaves and the command modules of LAYERS, nothing else
TOP_LEVEL = {name.removeprefix("xformer.") for floor in (LAYERS[0], LAYERS[7]) for name in floor}


def modules(package: str, folder: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        name = ".".join((package, *parts)).removesuffix(".__init__")
        out[name] = path
    return out


CORE = modules("xformer", ROOT / "xformer")


def imports(path: Path) -> tuple[set[str], set[str]]:
    """xformer modules imported at the top of the file, and those imported anywhere else."""
    tree = ast.parse(path.read_text())
    top, nested = set(), set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in CORE else node.module
                     for a in node.names]
        names = [n for n in names if n == "xformer" or n.startswith("xformer.")]
        (top if node in tree.body else nested).update(names)
    return top, nested


def layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of tests/test_layout.py"
    return best[0]


def test_imports_point_down_only_and_sit_at_the_top_of_each_file():
    problems = []
    for module, path in CORE.items():
        top, nested = imports(path)
        problems += [f"{module}: imports {n} inside a function (the graph must be visible)" for n in sorted(nested)]
        for target in sorted(top):
            if target != module and layer(target) > layer(module):
                problems.append(f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
    assert not problems, "\n".join(problems)


def test_the_top_level_holds_only_the_leaves_and_the_commands():
    flat = {path.stem for path in (ROOT / "xformer").glob("*.py")} - {"__init__"}
    folders = {path.name for path in (ROOT / "xformer").iterdir() if (path / "__init__.py").exists()}
    assert flat == TOP_LEVEL, f"top-level modules not in TOP_LEVEL: {sorted(flat - TOP_LEVEL)}"
    layered = {prefix.removeprefix("xformer.") for floor in LAYERS for prefix in floor}
    assert folders <= layered, f"packages in no layer: {sorted(folders - layered)}"


def test_the_model_and_the_config_never_import_data_or_tasks():
    for module, path in CORE.items():
        if module.startswith(("xformer.config", "xformer.model")):
            top, _ = imports(path)
            bad = [t for t in top if t.startswith(("xformer.data", "xformer.tasks"))]
            assert not bad, f"{module} imports {bad}"
        if module.startswith("xformer.data"):
            top, _ = imports(path)
            bad = [t for t in top if t.startswith(("xformer.model", "xformer.tasks", "xformer.training.checkpoint"))]
            assert not bad, f"{module} imports {bad}"


def test_the_module_graph_has_no_cycle():
    graph = {m: {t for t in imports(p)[0] if t != m and t != "xformer"} for m, p in CORE.items()}
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_every_module_imports_in_a_fresh_interpreter_without_the_cli_libraries():
    names = sorted(CORE)
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('typer', 'rich', 'click') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_no_module_shadows_a_standard_library_module():
    cli = modules("xformer_cli", ROOT / "cli")
    shadowing = [f"{m} ({p.relative_to(ROOT)})" for m, p in {**CORE, **cli}.items()
                 if m.rsplit(".", 1)[-1] in sys.stdlib_module_names]
    assert not shadowing, shadowing
