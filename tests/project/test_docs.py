"""The docs match the repository: a check that fails when README.md or docs/ drift from the code.

Three checks, each on the text as written (CPU; the CLI's parsers are built without torch):

1. Every repository path the docs name exists. The docs read: README.md, docs/*.md,
   plugins/*/README.md (plugins/kernels/README.md among them), runtime/README.md,
   builder/README.md, builder/recipes/*.md, benchmarks/README.md, benchmarks/kernels/README.md.
   In each, a *path* is

   - a Markdown link's target (``[text](target)``, not ``http(s):`` or ``mailto:``, its
     ``#anchor`` dropped), resolved against the doc's own folder; or
   - a word of the text (inside backticks, in a code block or in prose) that starts with
     a path root: a folder of the repository (``python/``, ``tests/``, ``plugins/``,
     ``runtime/``, ``scripts/``, ``docs/``, ``benchmarks/``, ``.ci/``), ``engram_trt/``
     (the package: ``python/engram_trt/``), or a folder or root module of the package
     (``models/``, ``native/``, ``cli/``, ..., ``errors.py``: the abbreviations
     docs/architecture.md uses, relative to ``python/engram_trt/``). The word must have a
     ``/`` (or be a root module) and not follow ``/``, ``.``, ``~``, ``$`` or a letter:
     ``/usr/local/cuda``, ``~/.cache/engram-trt`` and transformers'
     ``transformers/models/...`` are not ours;
   - a bare file name in backticks with a source extension (``.py``, ``.cu``, ``.cuh``,
     ``.h``, ``.cpp``, ``.sh``): ``gatherKernel.cu``;
   - a word starting with ``../`` or ``./``: relative to the doc's folder, as a link;
   - a dotted module name of the package, ``engram_trt.runtime.scheduler.Scheduler``: the
     packages and module as far as they go must exist, and the first name after them
     must be bound in that module (or package ``__init__``): defined, assigned, imported,
     or a lazy name's key;
   - a test's name, ``test_NAME`` (a module or a function): a file ``test_NAME.py`` or a
     ``def test_NAME`` under tests/ (or benchmarks/).

   A path with a slash exists when it names a file or folder of the repository (from
   its root; or, for the package roots, under ``python/engram_trt/``). ``<name>`` and
   ``*`` are wildcards that must match at least one (``models/<arch>/architecture.py``);
   ``a/b.attr`` (a module and a name in it: ``native/mhc.mhc_pre``) exists when
   ``a/b.py`` does; a trailing ``:LINE``, ``(...)`` or punctuation is dropped. A bare
   file name exists when some file of the repository has that name. docs/architecture.md
   names every module by its package-relative path, never by a bare name (a bare name
   there hid a module that had moved), so bare ``.py`` names are refused in it.
   Paths that are on purpose not in the repository are listed in ``NOT_IN_REPOSITORY``,
   each with its reason. docs/benchmarks.md records the commands its runs ran, some of
   scripts since removed: its first table maps each former script to the check and the
   ``bench`` command that replace it, and a former script is allowed there, and only
   there, when that table lists it (the scripts must be gone, their replacements exist).

2. Every ``engram-trt`` subcommand (the argparse parser of ``cli/main.py``) and every
   ``engram-trt bench`` subcommand (``cli/bench.py``'s ``BENCH_COMMANDS``) is named in
   the first column of README.md's command table (``engram-trt NAME ...``; bench
   commands as ``engram-trt bench NAME`` or in a ``bench a\\|b\\|c`` list), and the
   table names no command that does not exist. Every command line the docs show (in
   backticks or a code block: ``engram-trt CMD [SUBCOMMAND] ... --flag``) names a
   command, subcommand and flags its parser has (``NOT_COMMAND_LINES``: text that starts
   like one and is not, with its reason). The kernel microbenchmarks and probes that were
   ``bench`` commands are scripts under benchmarks/ now: docs/benchmarks.md's table of
   former commands maps each to its script, and there, and only there, a recorded
   ``engram-trt bench NAME --flag`` of a former command is checked against its script's
   flags (the same flags: ``cli.bench.script_parser``).

3. Every module of the package (``python/engram_trt/**/*.py``) is named in
   docs/architecture.md by its path relative to ``python/engram_trt/`` in backticks
   (``cli/main.py``). An ``__init__.py`` counts only when it holds code (a statement
   other than the docstring, imports and ``__all__``); its package's row (``tables/``)
   names it.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

from helpers.files import REPO

PACKAGE = REPO / "python" / "engram_trt"

DOCS = [
    "README.md",
    "docs/*.md",
    "plugins/*/README.md",
    "runtime/README.md",
    "builder/README.md",
    "builder/recipes/*.md",
    "benchmarks/README.md",
    "benchmarks/kernels/README.md",
]
REPO_ROOTS = ("python", "tests", "plugins", "runtime", "builder", "scripts", "docs", "benchmarks", ".ci")
SOURCE_EXTENSIONS = (".py", ".cu", ".cuh", ".h", ".cpp", ".sh")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "node_modules"}

# Named on purpose though not in the repository: {path as written: why}.
NOT_IN_REPOSITORY: dict[str, str] = {
    "engram_trt/lib/": "where `pip install` puts the compiled library in the installed package; a build output",
    "../elsewhere.safetensors": "docs/reliability.md: a hostile index entry the checkpoint reader refuses "
    "(a test input)",
    "python/openai/openai_frontend/main.py": "Triton's OpenAI frontend, a file of the triton-inference-server/server "
    "repository (docs/serving.md)",
}


def _doc_files() -> list[Path]:
    files: list[Path] = []
    for pattern in DOCS:
        files += sorted(REPO.glob(pattern))
    return files


@lru_cache(maxsize=None)
def _package_roots() -> tuple[str, ...]:
    """The package's folders and root modules: the first part of an abbreviated path."""
    return tuple(
        sorted(p.name for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py")
    )


@lru_cache(maxsize=None)
def _repo_files() -> tuple[Path, ...]:
    out: list[Path] = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO).parts
        if any(part in SKIP_DIRS or part.startswith("build") for part in rel[:-1]):
            continue
        if path.is_file():
            out.append(path)
    return tuple(out)


@lru_cache(maxsize=None)
def _basenames() -> frozenset[str]:
    return frozenset(p.name for p in _repo_files())


_DOTTED = re.compile(r"(?<![\w./])(engram_trt(?:\.\w+)+)")
_RELATIVE = re.compile(r"(?<![\w/.~$-])(\.\.?/[\w./*<>-]+)")
_WORD = re.compile(r"(?<![\w/.~$-])((?:\.ci|[A-Za-z_][\w-]*)(?:/[\w.*<>{}-]*)+|[A-Za-z_]\w*\.py)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_BACKTICK = re.compile(r"`([^`\n]+)`")
_BARE = re.compile(r"^[\w.-]+(" + "|".join(re.escape(e) for e in SOURCE_EXTENSIONS) + r")$")


def _clean(word: str) -> str:
    word = re.sub(r":\d+(-\d+)?$", "", word)
    return word.rstrip(".,;:'\"")


def _exists_under(base: Path, rel: str) -> bool:
    """``rel`` under ``base``: a file or folder, wildcards matching one, or ``mod.attr``."""
    if not rel:
        return base.exists()
    pattern = re.sub(r"<[^>/]*>|\{[^}/]*\}", "*", rel.rstrip("/"))
    if "*" in pattern:
        return any(True for _ in base.glob(pattern))
    if (base / pattern).exists():
        return True
    head, _, last = pattern.rpartition("/")
    stem = last.split(".", 1)[0]
    # `a/b.attr`: the module a/b.py and a name in it
    return bool(stem) and "." in last and (base / head / f"{stem}.py").is_file()


def path_exists(word: str, doc: Path | None = None, link: bool = False) -> bool:
    """Whether a path as a doc writes it names something of the repository (rule: module docstring)."""
    if link:
        return _exists_under(doc.parent if doc else REPO, word) or _exists_under(REPO, word)
    if word.startswith("engram_trt."):
        return dotted_exists(word)
    if "/" not in word:
        return word in _basenames()
    first = word.split("/", 1)[0]
    if first == "engram_trt":
        return _exists_under(PACKAGE, word.split("/", 1)[1])
    if first in REPO_ROOTS and _exists_under(REPO, word):
        return True
    return first in _package_roots() and _exists_under(PACKAGE, word)


def dotted_exists(name: str) -> bool:
    """``engram_trt.a.b.attr``: the packages / module as far as they go, then ``attr`` in its source."""
    parts = name.split(".")
    path = PACKAGE
    i = 1
    while i < len(parts):
        if (path / parts[i] / "__init__.py").is_file():
            path = path / parts[i]
        elif (path / f"{parts[i]}.py").is_file():
            path = path / f"{parts[i]}.py"
            i += 1
            break
        else:
            break
        i += 1
    if i == len(parts):
        return True
    source = (path / "__init__.py" if path.is_dir() else path).read_text()
    n = re.escape(parts[i])  # bound there: defined, assigned, imported, or a lazy name's key
    bound = rf"(def|class)\s+{n}\b|^\s*{n}\s*[:=]|^\s*(from\s+\S+\s+)?import\b[^\n]*\b{n}\b|[\"']{n}[\"']\s*:"
    return re.search(bound, source, re.M) is not None


def _is_candidate(word: str) -> bool:
    if "/" not in word:
        return word in _package_roots()
    first = word.split("/", 1)[0]
    return first in REPO_ROOTS or first == "engram_trt" or first in _package_roots()


def named_paths(doc: Path) -> list[tuple[int, str, bool]]:
    """(line, path as written, is a link target) for every path the doc names."""
    found: list[tuple[int, str, bool]] = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            found.append((lineno, target.split("#", 1)[0], True))
        for word in _WORD.findall(_LINK.sub("]", line)):
            word = _clean(word)
            if _is_candidate(word):
                found.append((lineno, word, False))
        for span in _BACKTICK.findall(line):
            span = _clean(span.strip())
            if _BARE.match(span):
                found.append((lineno, span, False))
        for word in _RELATIVE.findall(_LINK.sub("]", line)):
            found.append((lineno, _clean(word), True))
        for word in _DOTTED.findall(line):
            found.append((lineno, _clean(word), False))
    return found


BENCHMARKS = REPO / "docs" / "benchmarks.md"


def former_scripts() -> dict[str, tuple[list[str], list[str]]]:
    """docs/benchmarks.md's first table: former script -> (the checks now, the bench commands now)."""
    text = BENCHMARKS.read_text()
    table = text.split("| former script | checks now | timing now |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, tuple[list[str], list[str]]] = {}
    for line in table.splitlines()[2:]:
        cells = line.split("|")[1:4]
        checks = _BACKTICK.findall(cells[1])
        timing = [t.split()[1] if t.startswith("bench ") else t for t in _BACKTICK.findall(cells[2])]
        for name in _BACKTICK.findall(cells[0]):
            out[name] = (checks, timing)
    return out


def former_commands(doc: Path | None = None) -> dict[str, str]:
    """docs/benchmarks.md's table of former bench commands: name -> its script under benchmarks/."""
    text = (doc or BENCHMARKS).read_text()
    if "| former command | script now |" not in text:
        return {}
    table = text.split("| former command | script now |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        cells = line.split("|")[1:3]
        (script,) = _BACKTICK.findall(cells[1])
        for span in _BACKTICK.findall(cells[0]):
            out[span.split()[1]] = script
    return out


def script_flags(script: str) -> set[str]:
    """The flags of a script under benchmarks/ (``benchmarks/<folder>/<name>.py``), from its ``OPTIONS``."""
    from helpers.benchmark_scripts import module
    from engram_trt.cli.bench import script_parser

    folder, name = Path(script).parts[-2], Path(script).stem
    mod = module(folder, name)
    parser = script_parser(mod.OPTIONS, mod.__doc__ or "", Path(script).name)
    return {f for a in parser._actions for f in a.option_strings}


def _allowed(word: str, doc: Path) -> bool:
    if word in NOT_IN_REPOSITORY:
        return True
    return doc == BENCHMARKS and word.removeprefix("scripts/") in former_scripts()


@lru_cache(maxsize=None)
def _test_names() -> frozenset[str]:
    names: set[str] = set()
    for path in [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        names.add(path.stem)
        names.update(re.findall(r"def (test_\w+)", path.read_text()))
    return frozenset(names)


def _shown(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else doc.name


def missing_paths(docs: list[Path] | None = None) -> list[str]:
    missing = []
    for doc in docs if docs is not None else _doc_files():
        for lineno, word, link in named_paths(doc):
            if _allowed(word, doc) or path_exists(word, doc, link):
                continue
            missing.append(f"{_shown(doc)}:{lineno}: {word}")
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for name in re.findall(r"(?<![\w/.-])(test_\w+)", line):
                if name not in _test_names():
                    missing.append(f"{_shown(doc)}:{lineno}: {name} (no such test)")
    return missing


def test_every_path_the_docs_name_exists() -> None:
    missing = missing_paths()
    assert not missing, f"{len(missing)} paths named in the docs do not exist:\n" + "\n".join(missing)


def test_the_exceptions_are_named_and_not_in_the_repository() -> None:
    named = {word for doc in _doc_files() for _, word, _ in named_paths(doc)}
    for word, why in NOT_IN_REPOSITORY.items():
        assert word in named, f"NOT_IN_REPOSITORY lists {word!r}, which no doc names any more: drop it"
        assert not path_exists(word), f"{word!r} exists in the repository: drop it from NOT_IN_REPOSITORY"
        assert why.strip()


def test_former_scripts_are_gone_and_replaced() -> None:
    """The scripts docs/benchmarks.md's runs name are gone; what replaced each exists."""
    from engram_trt.cli.bench import BENCH_COMMANDS

    former = former_scripts()
    assert len(former) >= 10, former
    bench = {c.name for c in BENCH_COMMANDS}
    for name, (checks, timing) in former.items():
        assert not path_exists(name) and not (REPO / "scripts" / name).exists(), f"{name} exists: drop its row"
        for check in checks:
            where = REPO / check if "/" in check else REPO / "tests" / "gpu" / check
            assert where.is_file(), f"docs/benchmarks.md: {name} is now {check}, which is not in tests/gpu/"
        for command in timing:
            if command.startswith("benchmarks/"):
                assert (REPO / command).is_file(), f"docs/benchmarks.md: {name} is now {command}, which does not exist"
            else:
                assert command in bench, f"docs/benchmarks.md: {name} is now bench {command}, which does not exist"


def test_former_commands_are_gone_and_replaced() -> None:
    """The bench commands that moved to benchmarks/ are no commands; each one's script exists
    and takes the flags the runs docs/benchmarks.md records passed (checked with the command lines)."""
    from helpers.benchmark_scripts import SCRIPTS
    from engram_trt.cli.bench import BENCH_COMMANDS

    former = former_commands()
    assert former == {name: f"benchmarks/{path}" for name, path in SCRIPTS.items()}, former
    bench = {c.name for c in BENCH_COMMANDS}
    for name, script in former.items():
        assert name not in bench, f"bench {name} is a command: drop its row from docs/benchmarks.md"
        assert (REPO / script).is_file(), f"docs/benchmarks.md: bench {name} is now {script}, which does not exist"
        assert "--help" in script_flags(script) and len(script_flags(script)) > 2, script  # its OPTIONS' flags


def test_architecture_names_modules_by_their_package_path() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    bare = sorted(
        {s for s in _BACKTICK.findall(text) if re.fullmatch(r"\w+\.py", s.strip())}
        - {"__init__.py", "__main__.py", "errors.py", "paths.py"}
    )
    assert not bare, f"docs/architecture.md names modules by a bare file name (write e.g. `models/x.py`): {bare}"


# --- 2. the commands ------------------------------------------------------------------------------


def _command_table() -> list[str]:
    """The first cell of each row of README.md's command table (section "Command line")."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Command line", 1)[1].split("\n## ", 1)[0]
    cells = []
    for line in section.splitlines():
        if line.startswith("| `engram-trt"):
            cells.append(re.split(r"(?<!\\)\|", line)[1])
    return cells


def readme_commands() -> tuple[set[str], set[str]]:
    """(subcommands, bench subcommands) the README's command table names."""
    commands: set[str] = set()
    bench: set[str] = set()
    for cell in _command_table():
        for span in _BACKTICK.findall(cell):
            m = re.match(r"engram-trt ([\w-]+)(?: ([\w\\|-]+))?", span)
            if not m:
                continue
            commands.add(m.group(1))
            if m.group(1) == "bench" and m.group(2):
                bench.update(n for n in m.group(2).split("\\|") if n)
    return commands, bench


def cli_commands() -> set[str]:
    from engram_trt.cli.main import build_parser

    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    return set(sub.choices)


def test_every_command_is_in_the_readme_table() -> None:
    from engram_trt.cli.bench import BENCH_COMMANDS

    named, named_bench = readme_commands()
    actual, actual_bench = cli_commands(), {c.name for c in BENCH_COMMANDS}
    assert actual - named == set(), f"README.md's command table lacks: {sorted(actual - named)}"
    assert named - actual == set(), f"README.md's command table names no such commands: {sorted(named - actual)}"
    lacking, extra = sorted(actual_bench - named_bench), sorted(named_bench - actual_bench)
    assert not lacking, f"README.md's command table lacks: bench {lacking}"
    assert not extra, f"README.md names no such bench commands: {extra}"


# `engram-trt ...` text that is not a command line: (prefix, why)
NOT_COMMAND_LINES = {"engram-trt lock pid": "the mark inside a lock file (docs/reliability.md)"}
NOT_COMMANDS = tuple(NOT_COMMAND_LINES)


def _shown_commands(doc: Path) -> list[tuple[int, str]]:
    """(line, text) of every ``engram-trt ...`` in backticks or a fenced code block."""
    out: list[tuple[int, str]] = []
    fenced = False
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        spans = [line] if fenced else _BACKTICK.findall(line)
        for span in spans:
            out += [(lineno, m) for m in re.findall(r"engram-trt (?:\\\||[^`|;&#\n])*", span)]
    return out


def command_problems() -> list[str]:
    import argparse

    from engram_trt.cli.main import build_parser

    def flags(p: argparse.ArgumentParser) -> set[str]:
        return {f for a in p._actions for f in a.option_strings}

    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    problems = []
    for doc in _doc_files():
        former = former_commands() if doc == BENCHMARKS else {}
        for lineno, text in _shown_commands(doc):
            words = text.split()[1:]
            if not words or words[0].startswith("-"):
                continue
            where = f"{doc.relative_to(REPO)}:{lineno}: {text.strip()}"
            if not re.fullmatch(r"[a-z][a-z0-9-]*", words[0]) or text.startswith(NOT_COMMANDS):
                continue  # `engram-trt build: ...` in prose, `engram-trt bench ...`
            if words[0] not in sub.choices:
                problems.append(f"{where}: no command {words[0]!r}")
                continue
            parser = sub.choices[words[0]]
            rest = words[1:]
            nested = (
                [
                    a
                    for a in parser._subparsers._group_actions  # type: ignore[union-attr]
                    if isinstance(a, argparse._SubParsersAction)
                ]
                if parser._subparsers
                else []
            )
            if nested and rest and re.fullmatch(r"[a-z][a-z0-9\\|-]*", rest[0]):
                names = rest[0].split("\\|")
                unknown = [n for n in names if n not in nested[0].choices and n not in former]
                if unknown:
                    problems.append(f"{where}: no {words[0]} command {unknown}")
                    continue
                if names[0] in former:  # a recorded run of a command that is a script now
                    known = script_flags(former[names[0]])
                else:
                    known = flags(nested[0].choices[names[0]])
                rest = rest[1:]
            else:
                known = flags(parser)
            for w in rest:
                m = re.match(r"\[?(--[a-z][\w-]*)", w)
                if m and m.group(1) not in known and not w.lstrip("[").startswith("--engram-config."):
                    problems.append(f"{where}: no flag {m.group(1)}")
    return problems


def test_every_command_line_the_docs_show_parses() -> None:
    problems = command_problems()
    assert not problems, f"{len(problems)} command lines in the docs name what the CLI lacks:\n" + "\n".join(problems)


# --- 3. the modules -------------------------------------------------------------------------------


def _holds_code(init: Path) -> bool:
    body = ast.parse(init.read_text()).body
    for i, node in enumerate(body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
        return True
    return False


def package_modules() -> list[str]:
    """Every module's path relative to python/engram_trt/; an __init__ holding code as its folder (``tables/``)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py":
            if not _holds_code(path):
                continue
            rel = rel[: -len("__init__.py")] or "__init__.py"
        out.append(rel)
    return out


def test_every_module_is_in_the_architecture_doc() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    spans = {s.strip() for s in _BACKTICK.findall(text)}
    named = spans | {s.removeprefix("python/engram_trt/") for s in spans}
    absent = [m for m in package_modules() if m not in named]
    assert not absent, f"docs/architecture.md does not name {len(absent)} modules (by their package path): {absent}"


def test_the_rules_find_what_they_should() -> None:
    """The checks themselves: a moved module, a removed script, an abbreviation, a wildcard, a link."""
    assert path_exists("python/engram_trt/cli/main.py") and path_exists("cli/main.py")
    assert path_exists("engram_trt/cli/main.py") and path_exists("models/<arch>/architecture.py")
    assert path_exists("native/mhc.mhc_pre") and path_exists("gatherKernel.cu")
    assert path_exists("plugins/engram*Plugin/") and path_exists("tests/gpu/")
    assert not path_exists("runtime/step.py") and not path_exists("cachereference.py")
    assert not path_exists("models/<arch>/no_such_module.py") and not path_exists("native/nothing.attr")
    assert path_exists("../README.md", REPO / "docs" / "x.md", link=True)
    assert not path_exists("nothing.md", REPO / "docs" / "x.md", link=True)
    assert _holds_code(PACKAGE / "tables" / "__init__.py") and not _holds_code(PACKAGE / "models" / "__init__.py")
    text = "see `runtime/step.py`, /usr/local/cuda, ~/.cache/x, models/y.py and `gatherKernel.cu`"
    words = [w for _, w, _ in named_paths_of(text)]
    assert words == ["runtime/step.py", "models/y.py", "gatherKernel.cu"]
    assert path_exists("engram_trt.runtime.scheduler.Scheduler") and path_exists("engram_trt.LLM")
    assert path_exists("engram_trt.engram.hashing.hash_batch_packed") and path_exists("engram_trt.native")
    assert not path_exists("engram_trt.hashing.hash_batch_packed") and not path_exists("engram_trt.runtime.step")
    assert not path_exists("engram_trt.runtime.scheduler.NoSuchName")
    words = [w for _, w, _ in named_paths_of("`../bench/uva_probe.py`; engram_trt.hashing.hash_ids.")]
    assert words == ["../bench/uva_probe.py", "engram_trt.hashing.hash_ids"]


def test_the_command_check_finds_what_it_should(monkeypatch, tmp_path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "`engram-trt shm list --bogus`, `engram-trt bench serve PATH --concurrency 1 --nope`\n"
        "```\nengram-trt run PATH --no-such\nengram-trt bench serve\\|nobench\n```\n"
        "`engram-trt frobnicate`, `engram-trt build CK -o OUT --dtype fp16`, engram-trt keeps (prose)\n"
    )
    monkeypatch.setattr(__import__(__name__), "_doc_files", lambda: [doc])
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    found = [p.split(": ", 1)[1].rsplit(": ", 1)[1] for p in command_problems()]
    assert found == [
        "no flag --bogus",
        "no flag --nope",
        "no flag --no-such",
        "no bench command ['nobench']",
        "no command 'frobnicate'",
    ], found


def test_a_former_command_is_checked_against_its_script_in_the_benchmarks_doc_only(monkeypatch, tmp_path) -> None:
    """A recorded run of a command that is a script now parses against the script's flags in
    docs/benchmarks.md (its table of former commands naming the script); elsewhere it is no command."""
    bench_doc, other = tmp_path / "benchmarks.md", tmp_path / "x.md"
    bench_doc.write_text(
        "| former command | script now |\n| --- | --- |\n"
        "| `bench gather` | `benchmarks/lookup/bench_gather.py` |\n\n"
        "`engram-trt bench gather --threads 4 --dry-run`, `engram-trt bench gather --no-such`\n"
    )
    other.write_text("`engram-trt bench gather --threads 4`\n")
    assert former_commands(bench_doc) == {"gather": "benchmarks/lookup/bench_gather.py"}
    assert {"--threads", "--dry-run", "--json"} <= script_flags("benchmarks/lookup/bench_gather.py")
    monkeypatch.setattr(__import__(__name__), "_doc_files", lambda: [bench_doc, other])
    monkeypatch.setattr(__import__(__name__), "BENCHMARKS", bench_doc)
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    found = [p.split(": ", 1)[0] + ": " + p.rsplit(": ", 1)[1] for p in command_problems()]
    assert found == ["benchmarks.md:5: no flag --no-such", "x.md:1: no bench command ['gather']"], found


def test_the_path_check_finds_what_it_should(tmp_path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "`runtime/step.py` and `models/step.py`; tests/project/test_docs.py::test_no_such_check and "
        "test_cli.py; [spec](docs/engram-spec.md), [gone](nowhere.md); engram_trt.runtime.step.PackedStep\n"
    )
    found = [m.split(": ", 1)[1] for m in missing_paths([doc])]
    assert found == [
        "nowhere.md",
        "runtime/step.py",
        "engram_trt.runtime.step.PackedStep",
        "test_no_such_check (no such test)",
    ], found


def named_paths_of(text: str) -> list[tuple[int, str, bool]]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        doc = Path(tmp) / "x.md"
        doc.write_text(text)
        return named_paths(doc)
