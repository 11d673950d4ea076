"""The package's import graph, built from the source with ``ast``: no module imports
itself through others (no circle, lazy imports inside functions included), and no
subpackage imports one above it in the layer order of docs/architecture.md. The
package's root holds only ``__init__``, ``__main__``, ``errors`` and ``paths``. The package
imports nothing of the repository outside it: the scripts under benchmarks/ and the tests'
modules (tests/gpu/cases.py among them) import the package, never the other way."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from helpers.files import REPO

PACKAGE = REPO / "python" / "engram_trt"

# Low to high; a module may import its own subpackage or any subpackage at or below
# its layer (docs/architecture.md, "Layers"). Subpackages of one layer never import
# each other.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "paths"),
    ("config", "storage"),
    ("engram",),
    ("native",),
    ("quant",),
    ("checkpoint",),
    ("tables",),
    ("cache",),
    ("models",),
    ("builder",),
    ("runtime",),
    ("llmapi",),
    ("distributed",),
    ("triton",),
    ("bench",),
    ("cli",),
    ("__main__",),
]
ROOT_MODULES = {"__init__.py", "__main__.py", "errors.py", "paths.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    """``{module: modules it imports}`` over the package (every import statement,
    module level or inside a function), and each module's file."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]
            for t in targets:
                while t and t not in files:  # `import engram_trt.a.b` names module a.b
                    t = t.rpartition(".")[0]
                if t.startswith("engram_trt") and t != name:
                    edges[name].add(t)
    return edges, files


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top == "__init__":
        return 0
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(
        f"{module}: subpackage '{top}' is not in the layer order; add it to LAYERS and docs/architecture.md"
    )


def test_the_graph_is_read() -> None:
    edges, files = import_graph()
    assert "engram_trt.errors" in edges["engram_trt.native.library"]
    assert len(files) > 100 and sum(map(len, edges.values())) > 300


def test_no_import_circles() -> None:
    edges, _ = import_graph()
    assert circles(edges) == []


def test_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_from_a_higher_layer() -> None:
    edges, _ = import_graph()
    upward = sorted(
        f"{a} -> {b}"
        for a, bs in edges.items()
        for b in bs
        if layer_of(b) > layer_of(a)
        or (
            layer_of(b) == layer_of(a)
            and a.split(".")[1:2] != b.split(".")[1:2]
            and len(b.split(".")) > 1
            and layer_of(a) > 0
        )
    )
    assert upward == []


def test_package_root_holds_only_the_four_modules() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ROOT_MODULES)
    assert loose == []


def test_every_subpackage_is_layered() -> None:
    for d in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        assert any(d.name in names for names in LAYERS), f"{d.name} is not in LAYERS"


def outside_imports() -> list[str]:
    """``module -> name`` for each import in the package of a module of benchmarks/ or tests/
    (their file names, as a script or test that puts its folder on ``sys.path`` imports them)."""
    outside = {p.stem for d in ("benchmarks", "tests") for p in (REPO / d).rglob("*.py")} - {"__init__"}
    outside |= {"benchmarks", "tests"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [f"{module_name(path)} -> {n}" for n in names if n.split(".")[0] in outside]
    return found


def test_the_package_imports_neither_benchmarks_nor_tests() -> None:
    assert "cases" in {p.stem for p in (REPO / "tests" / "gpu").glob("*.py")}  # the GPU cases live with the tests
    assert not (PACKAGE / "bench" / "gpucases.py").exists()
    assert outside_imports() == []
