"""The C++ / CUDA dependency graph of plugins/ and runtime/: no include cycle, no cycle
between translation units, and each folder depends only on the folders below it.

Why: a cycle between two .cpp files (each using what the other defines) makes them one
unit in all but name: neither can be read, tested or replaced alone. The one there was,
``runtime/hostGather.cpp`` <-> ``runtime/hostGatherApi.cpp`` (the pipeline used the
gatherer whose destructor the API file defined, the API file called the pipeline), was
broken by moving the gatherer's state into ``runtime/hostGatherer.cpp``; this test keeps
it broken, and keeps the layers of docs/architecture.md ("C++ layers"):

    plugins/kernels/   the kernel library          -> kernels/ only
    plugins/common/    the plugins' shared base    -> common/, kernels/
    plugins/<plugin>/  one TensorRT adapter each   -> its own folder, common/, kernels/
    plugins/engramPlugins.cpp (the registration)   -> the plugin folders, common/, kernels/
    runtime/           the host side of serving    -> runtime/, kernels/ (never a plugin)
    */tests/           test programs               -> anything

Edges, read from the source text (comments and string literals removed):
  * include: A ``#include "B"`` (resolved beside A, then under plugins/ and runtime/, the
    library's include directories: CMakeLists.txt);
  * translation unit (.cpp / .cu -> .cpp / .cu), at header level: B defines, with external
    linkage, a function that a header A includes (directly or not) names, and A uses that
    name (itself or through a macro of those headers); or B defines a member of a class out
    of line, the class is named in a header A includes, and A names the class.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from helpers.files import REPO

TOPS = ("plugins", "runtime")
INCLUDE_DIRS = ("plugins", "runtime")  # CMakeLists.txt: target_include_directories(engram_trt_plugins ...)
SOURCES = {".cpp", ".cu"}
HEADERS = {".h", ".cuh"}
KEYWORDS = {
    "if",
    "for",
    "while",
    "switch",
    "catch",
    "return",
    "sizeof",
    "decltype",
    "alignof",
    "static_assert",
    "alignas",
    "noexcept",
    "defined",
    "__launch_bounds__",
}
IDENT = re.compile(r"[A-Za-z_]\w*")
USE = re.compile(r"(?<![\w.])(?<!->)(?<!std::)(?<!std :: )([A-Za-z_]\w*)")

Graph = dict[str, set[str]]


# --- reading the sources ---------------------------------------------------------------------------


def strip(text: str) -> str:
    """The code without comments and literals (each string / char literal becomes an empty
    one) and without preprocessor lines (continuations included), line breaks kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            out.append(" " + "\n" * text.count("\n", i, n if j < 0 else j))
            i = n if j < 0 else j + 2
        elif text[i] in "\"'" and not (text[i] == "'" and i and text[i - 1].isalnum()):  # 1'000 is a number
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(q + q)
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    lines, keep, cont = "".join(out).split("\n"), [], False
    for line in lines:
        directive = cont or line.lstrip().startswith("#")
        cont = directive and line.rstrip().endswith("\\")
        keep.append("" if directive else line)
    return "\n".join(keep)


def macros_of(raw: str) -> dict[str, str]:
    """``#define NAME body`` of a file (continuations joined), body without comments."""
    joined = raw.replace("\\\n", " ")
    return {m.group(1): strip(m.group(2)) for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(.*)$", joined, re.M)}


def function_name(head: str) -> str | None:
    """The (qualified) name a function definition's head declares, or None when the text
    before the ``{`` is no function head (a class, an initializer, a control statement)."""
    h = re.sub(r"\s+", " ", head).strip()
    while h.startswith("template"):  # drop template parameter lists
        depth, k = 0, h.find("<")
        if k < 0:
            return None
        for k in range(k, len(h)):
            depth += {"<": 1, ">": -1}.get(h[k], 0)
            if depth == 0:
                break
        h = h[k + 1 :].strip()
    if re.match(r"(class|struct|union|enum)\b", h):
        return None
    depth = 0
    for k, ch in enumerate(h):
        if ch in "<[":
            depth += 1
        elif ch in ">]":
            depth -= 1
        elif ch == "=" and depth <= 0 and h[k - 1 : k + 1] not in ("==", "!=", "<=", ">=") and "operator" not in h[:k]:
            return None  # an initializer: `auto f = [] (...) {`, `T table[] = {`
        elif ch == "(" and depth <= 0:
            m = re.search(r"((?:\w+\s*::\s*)*~?\w+)\s*$", h[:k])
            if not m or "operator" in h[:k]:
                return None
            name = re.sub(r"\s+", "", m.group(1))
            return None if name.split("::")[-1] in KEYWORDS else name
    return None


class Unit:
    """One file: its includes, macros, identifiers and (for .cpp / .cu) its definitions
    with external linkage: free functions by name, out-of-line members by class."""

    def __init__(self, rel: str, raw: str) -> None:
        self.rel, self.raw = rel, raw
        self.text = strip(raw)
        self.includes = re.findall(r'^\s*#\s*include\s*"([^"]+)"', raw, re.M)
        self.macros = macros_of(raw)
        self.idents = set(IDENT.findall(self.text)) | {i for body in self.macros.values() for i in IDENT.findall(body)}
        self.functions: set[str] = set()  # free functions defined here with external linkage
        self.classes: set[str] = set()  # classes whose members are defined here out of line
        self.own: set[str] = set()  # every name defined here (external or internal)
        if Path(rel).suffix in SOURCES:
            self._definitions()

    def _definitions(self) -> None:
        text, stack, start, i = self.text, [], 0, 0
        while i < len(text):
            c = text[i]
            if c in ";}":
                if c == "}" and stack:
                    stack.pop()
                start = i + 1
            elif c == "{":
                head = re.sub(r"\s+", " ", text[start:i]).strip()
                at_scope = all(kind in ("namespace", "anonymous", "extern") for kind in stack)
                if re.fullmatch(r"(inline )?namespace \w+(::\w+)*", head):
                    stack.append("namespace")
                elif re.fullmatch(r"(inline )?namespace", head):
                    stack.append("anonymous")
                elif head == 'extern ""':
                    stack.append("extern")
                elif at_scope and (name := function_name(head)) is not None:
                    parts = name.split("::")
                    self.own.add(parts[-1])
                    if "anonymous" not in stack and not re.search(r"(^| )static ", head):
                        if len(parts) >= 2 and parts[-2][:1].isupper():
                            self.classes.add(parts[-2])  # Class::member defined out of line
                        else:
                            self.functions.add(parts[-1])
                    depth, j = 1, i + 1  # skip the body
                    while j < len(text) and depth:
                        depth += {"{": 1, "}": -1}.get(text[j], 0)
                        j += 1
                    i, start = j, j
                    continue
                else:
                    stack.append("block")
                start = i + 1
            i += 1

    def uses(self, macros: dict[str, str]) -> set[str]:
        """Identifiers this file uses outside a member access or ``std::``, with the bodies
        of the macros (of the headers it reaches) it names, expanded."""
        found, todo, seen = set(), [self.text], set()
        while todo:
            for name in USE.findall(todo.pop()):
                found.add(name)
                if name in macros and name not in seen:
                    seen.add(name)
                    todo.append(macros[name])
        return found


def read_tree(files: dict[str, str]) -> dict[str, Unit]:
    return {rel: Unit(rel, raw) for rel, raw in files.items()}


def repo_files(repo: Path = REPO) -> dict[str, str]:
    out = {}
    for top in TOPS:
        for p in sorted((repo / top).rglob("*")):
            if p.is_file() and p.suffix in SOURCES | HEADERS:
                out[p.relative_to(repo).as_posix()] = p.read_text(errors="replace")
    return out


# --- the graphs --------------------------------------------------------------------------------------


def _resolve(rel: str, inc: str, units: dict[str, Unit]) -> str | None:
    for base in (str(Path(rel).parent), *INCLUDE_DIRS):
        parts: list[str] = []
        for piece in f"{base}/{inc}".split("/"):
            if piece == "..":
                if parts:
                    parts.pop()
            elif piece not in ("", "."):
                parts.append(piece)
        if "/".join(parts) in units:
            return "/".join(parts)
    return None


def include_graph(units: dict[str, Unit]) -> Graph:
    """File -> the files its ``#include "..."`` lines name (those found in the tree)."""
    g: Graph = {rel: set() for rel in units}
    for rel, u in units.items():
        g[rel] |= {t for inc in u.includes if (t := _resolve(rel, inc, units)) is not None}
    return g


def reach(g: Graph, start: str) -> set[str]:
    """Every node reachable from ``start`` (itself excluded unless on a cycle)."""
    seen, todo = set(), list(g.get(start, ()))
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(g.get(v, ()))
    return seen


def unit_graph(units: dict[str, Unit], includes: Graph) -> dict[str, dict[str, set[str]]]:
    """Translation unit -> translation unit -> the names that make the edge (module text)."""
    sources = {r: u for r, u in units.items() if Path(r).suffix in SOURCES}
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for rel, u in sources.items():
        headers = [units[h] for h in reach(includes, rel) if Path(h).suffix in HEADERS]
        declared = set().union(*(h.idents for h in headers)) if headers else set()
        used = u.uses({k: v for h in headers for k, v in h.macros.items()} | u.macros)
        for other, v in sources.items():
            if other == rel:
                continue
            names = (v.functions & declared & used) - u.own
            names |= {f"{c} (members)" for c in v.classes & declared & used if c not in u.classes}
            if names:
                edges[rel][other] |= names
    return edges


def cycles(g: dict[str, set[str]] | dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Every strongly connected component of more than one node, and every node with an
    edge to itself (Tarjan, iterative), each sorted."""
    nodes = sorted(set(g) | {w for ws in g.values() for w in ws})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in g.get(v, ()):
                    out.append(sorted(comp))
    return sorted(out)


# --- the layers ---------------------------------------------------------------------------------------


def component(rel: str) -> str:
    """The layer a file belongs to (see the module's text)."""
    parts = rel.split("/")
    if "tests" in parts[:-1]:
        return "tests"
    if parts[0] == "runtime":
        return "runtime"
    if len(parts) == 2:
        return "registration"  # plugins/engramPlugins.cpp
    return {"kernels": "kernels", "common": "common"}.get(parts[1], f"plugin:{parts[1]}")


def allowed(src: str, dst: str) -> bool:
    a, b = component(src), component(dst)
    if a == "tests" or a == b:
        return True
    if a == "kernels":
        return False
    if a in ("common", "runtime"):
        return b == "kernels"
    if a.startswith("plugin:"):
        return b in ("common", "kernels")
    return a == "registration" and (b in ("common", "kernels") or b.startswith("plugin:"))


def violations(g: dict[str, set[str]] | dict[str, dict[str, set[str]]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in g.items() for b in bs if not allowed(a, b))


# --- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree():
    units = read_tree(repo_files())
    includes = include_graph(units)
    return units, includes, unit_graph(units, includes)


def _explain(found: list[list[str]], g) -> str:
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        for a in comp:
            for b in sorted(g.get(a, ())):
                if b in comp:
                    why = g[a][b] if isinstance(g[a], dict) else "#include"
                    lines.append(f"  {a} -> {b}: {', '.join(sorted(why)) if not isinstance(why, str) else why}")
    return "\n".join(lines)


def test_no_include_cycle(tree) -> None:
    units, includes, _ = tree
    assert len(units) > 30 and sum(map(len, includes.values())) > 50  # the tree was read
    found = cycles(includes)
    assert not found, "include cycle(s):\n" + _explain(found, includes)


def test_no_cycle_between_translation_units(tree) -> None:
    _, _, tus = tree
    # The scanner sees the edges that are known to be there (else "no cycle" says nothing):
    # the API calls the pipeline, the pipeline and the driver use the gatherer's state.
    assert "hostGather" in tus["runtime/hostGatherApi.cpp"]["runtime/hostGather.cpp"]
    assert "EngramHostGatherer (members)" in tus["runtime/hostGather.cpp"]["runtime/hostGatherer.cpp"]
    assert "EngramHostGatherer (members)" in tus["runtime/gatherDriver.cpp"]["runtime/hostGatherer.cpp"]
    assert "launchGather" in tus["runtime/hostGather.cpp"]["plugins/kernels/gatherKernel.cu"]
    assert "throwPluginError" in tus["plugins/common/pluginFields.cpp"]["plugins/common/checkMacros.cpp"]  # via a macro
    found = cycles(tus)
    assert not found, "cycle(s) between translation units:\n" + _explain(found, tus)


def test_layers(tree) -> None:
    _, includes, tus = tree
    bad = violations(includes) + violations(tus)
    assert not bad, "dependencies against the C++ layers (docs/architecture.md):\n" + "\n".join(bad)


# --- the checker itself, on synthetic inputs -----------------------------------------------------------


def test_cycle_finder_on_synthetic_graphs() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert cycles(g) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}}) == [["p", "q"], ["x", "y"]]
    chain = {str(i): {str(i + 1)} for i in range(5000)}  # deep: no recursion limit
    assert cycles(chain) == [] and cycles(chain | {"5000": {"0"}}) == [sorted(map(str, range(5001)))]


def test_the_former_host_gather_cycle_is_found() -> None:
    """A tree shaped as runtime/ was before hostGatherer.cpp: the pipeline file uses the
    gatherer whose destructor the API file defines, the API file calls the pipeline."""
    files = {
        "runtime/internal.h": "#pragma once\nstruct Gatherer { ~Gatherer(); int n; };\n"
        "namespace k { int hostGather(Gatherer* g); }\n#define CHECK(x) k::fail(x)\n"
        "namespace k { int fail(int); }\n",
        "runtime/pipeline.cpp": '#include "internal.h"\nnamespace k {\nint hostGather(Gatherer* g) {\n'
        "  Gatherer tmp; return g->n; }\n}\n",
        "runtime/api.cpp": '#include "internal.h"\n// hostGather( in a comment is no use\n'
        "Gatherer::~Gatherer() { }\nextern \"C\" int engram_gather(Gatherer* g) {\n"
        "  return k::hostGather(g); }\n",
        "plugins/kernels/fail.cpp": '#include "../../runtime/internal.h"\n'
        "namespace k { int fail(int x) { return x; } }\n",
        "plugins/kernels/user.cpp": '#include "internal.h"\nstatic int hostGather(int) { return 0; }\n'
        "int use() { return CHECK(1) + hostGather(2); }\n",
    }
    units = read_tree(files)
    includes = include_graph(units)
    tus = unit_graph(units, includes)
    assert includes["plugins/kernels/fail.cpp"] == {"runtime/internal.h"}  # ../ resolved
    assert includes["plugins/kernels/user.cpp"] == {"runtime/internal.h"}  # through the include directory
    assert tus["runtime/pipeline.cpp"]["runtime/api.cpp"] == {"Gatherer (members)"}
    assert tus["runtime/api.cpp"]["runtime/pipeline.cpp"] == {"hostGather"}
    assert cycles(tus) == [["runtime/api.cpp", "runtime/pipeline.cpp"]]
    # the macro's call is a use; a static function of the same name is the file's own
    assert dict(tus["plugins/kernels/user.cpp"]) == {"plugins/kernels/fail.cpp": {"fail"}}
    assert violations(includes) == [
        "plugins/kernels/fail.cpp -> runtime/internal.h",
        "plugins/kernels/user.cpp -> runtime/internal.h",
    ]
    # the fix: the destructor in a file of its own breaks the cycle
    files["runtime/gatherer.cpp"] = '#include "internal.h"\nGatherer::~Gatherer() { }\n'
    files["runtime/api.cpp"] = files["runtime/api.cpp"].replace("Gatherer::~Gatherer() { }\n", "")
    units = read_tree(files)
    assert cycles(unit_graph(units, include_graph(units))) == []


def test_an_include_cycle_and_layer_breaks_are_found() -> None:
    files = {
        "plugins/kernels/a.h": '#include "b.h"\n',
        "plugins/kernels/b.h": '#include "a.h"\n',
        "plugins/kernels/k.cu": '#include "common/base.h"\n',
        "plugins/common/base.h": '#include "kernels/a.h"\n',
        "plugins/engramGatePlugin/g.cpp": '#include "engramGatherPlugin/x.h"\n#include "common/base.h"\n',
        "plugins/engramGatherPlugin/x.h": "",
        "runtime/r.cpp": '#include "engramGatePlugin/g.h"\n',
        "plugins/engramGatePlugin/g.h": "",
        "plugins/engramPlugins.cpp": '#include "engramGatePlugin/g.h"\n',
        "plugins/tests/t.cpp": '#include "engramGatePlugin/g.h"\n#include "../../runtime/r.h"\n',
        "runtime/r.h": "",
    }
    includes = include_graph(read_tree(files))
    assert cycles(includes) == [["plugins/kernels/a.h", "plugins/kernels/b.h"]]
    assert violations(includes) == [
        "plugins/engramGatePlugin/g.cpp -> plugins/engramGatherPlugin/x.h",
        "plugins/kernels/k.cu -> plugins/common/base.h",
        "runtime/r.cpp -> plugins/engramGatePlugin/g.h",
    ]


def test_strip_and_function_heads() -> None:
    text = strip('int a; // x {\n/* { */ const char* s = "}{"; char c = \'{\';\n#define M(x) \\\n  { x }\nint b;\n')
    assert "{" not in text and "}" not in text and text.count("\n") == 5
    assert function_name("static inline int foo(int a, int b) const") == "foo"
    assert function_name("template <typename T, int N> __global__ void kern(T* p)") == "kern"
    assert function_name("Gatherer::~Gatherer()") == "Gatherer::~Gatherer"
    assert function_name("cudaError_t k :: launch (int)") == "k::launch"
    for not_a_function in (
        "struct Foo",
        "class Bar : public Baz",
        "auto f = [](int x)",
        "if (x)",
        "int table[] =",
        "namespace x",
        "bool operator==(const A& o)",
    ):
        assert function_name(not_a_function) is None, not_a_function
