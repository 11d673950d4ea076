"""The one place that imports TensorRT: full ``tensorrt`` if present, else TensorRT-RTX.

Both flavours expose the same Python API shape (``Builder``, ``OnnxParser``,
``IBuilderConfig``...), so the builder and the runtime share every code path and
branch only through the helpers here, where the two really differ:

* **Module names.** Full TensorRT is ``tensorrt``. The TensorRT-RTX PyPI wheels
  (``tensorrt-rtx-cu13-bindings``/``-libs``) install the module
  ``tensorrt_rtx_bindings`` (other RTX packagings name it ``tensorrt_rtx``); all are
  tried, in that order. ``ENGRAM_TRT_FLAVOUR=tensorrt|tensorrt_rtx`` forces one.
* **The RTX ONNX parser** dlopens ``libtensorrt_rtx.so`` while the wheel ships only
  ``libtensorrt_rtx.so.1``; without the unversioned name the process aborts
  ("terminate called without an active exception"), which no ``try`` can catch. So the
  link is made *before* the parser is created: beside the library when that folder is
  writable, else in a cache folder from which the libraries are pre-loaded (the
  parser's RPATH is ``$ORIGIN``, so loading it through the cache folder makes the
  loader look there).
* **Plugin libraries**: ``load_library`` reports nothing when no ``Builder(logger)``
  exists yet, so :func:`load_plugin_library` creates one first and checks the result.
* **Targets**: an RTX engine is compiled ahead of time for listed compute
  capabilities (``SM80``, ``SM86``...), full TensorRT builds for the GPU at hand.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Sequence

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

FLAVOURS = ("tensorrt", "tensorrt_rtx")
# Import names tried per flavour, first found wins.
_MODULE_NAMES = {
    "tensorrt": ("tensorrt",),
    "tensorrt_rtx": ("tensorrt_rtx", "tensorrt_rtx_bindings"),
}
_RTX_LIBS_PACKAGE = "tensorrt_rtx_libs"
_RTX_LIB = "libtensorrt_rtx.so"
_RTX_PARSER_LIB = "libtensorrt_onnxparser_rtx.so"
# Compute capabilities an RTX engine can be compiled for (TensorRT-RTX 1.7).
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
# The targets TensorRT-RTX compiles FP8 types for (sm89 and later): an engine whose graph
# holds FP8 weights (DequantizeLinear of FLOAT8E4M3FN) cannot be built for sm75 / sm80 /
# sm86 ("Cannot compile for target(s) sm80 ... HW-specific datatypes: fp8_e4m3").
FP8_TARGETS = tuple(t for t in RTX_TARGETS if int(t[2:]) >= 89)

NOT_INSTALLED_REASON = "the tensorrt module is not installed (full TensorRT is not installable on this machine)"


class TensorRTUnavailable(EngramError):
    """No TensorRT builder can be imported (neither ``tensorrt`` nor TensorRT-RTX)."""


@dataclass(frozen=True)
class TRT:
    """The imported TensorRT module and what it is."""

    module: ModuleType
    flavour: str  # 'tensorrt' | 'tensorrt_rtx'
    module_name: str
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.flavour == "tensorrt_rtx"


_loaded: TRT | None = None
_rtx_link: Path | None = None
_logger: Any = None
_builders: list[Any] = []  # keeps the Builder that owns the plugin registry's logger alive


def _rtx_libs_dir() -> Path | None:
    spec = importlib.util.find_spec(_RTX_LIBS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _cache_dir() -> Path:
    from engram_trt.paths import cache_root

    return cache_root() / "trt-rtx-libs"


def _link(target: Path, link: Path) -> None:
    """Create ``link -> target`` atomically (a concurrent process may race us)."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_rtx_parser_link(force_cache: bool | None = None) -> Path | None:
    """Make ``libtensorrt_rtx.so`` findable by the RTX ONNX parser; returns the link made
    or found (None when no RTX libs package is installed, e.g. with full TensorRT).

    Must run before ``tensorrt_rtx_libs`` is imported for the cache-folder route to work,
    since that route pre-loads the libraries *through* the cache folder.
    ``ENGRAM_TRT_RTX_LINK_IN_CACHE=1`` forces the cache route (tests use it).
    """
    global _rtx_link
    if _rtx_link is not None:
        return _rtx_link
    libs = _rtx_libs_dir()
    if libs is None:
        return None
    real = libs / f"{_RTX_LIB}.1"
    if not real.is_file():
        raise TensorRTUnavailable(
            f"the TensorRT-RTX libs package at '{libs}' has no {real.name}; "
            "reinstall it: pip install --force-reinstall tensorrt-rtx-cu13-libs"
        )
    beside = libs / _RTX_LIB
    if force_cache is None:
        force_cache = os.environ.get("ENGRAM_TRT_RTX_LINK_IN_CACHE", "") not in ("", "0")
    if not force_cache:
        if beside.exists():
            _rtx_link = beside
            return beside
        if os.access(libs, os.W_OK):
            try:
                _link(Path(real.name), beside)  # relative link: survives moving the env
                log.info("created %s -> %s (the RTX ONNX parser loads the unversioned name)", beside, real.name)
                _rtx_link = beside
                return beside
            except OSError as exc:
                log.debug("cannot link in %s (%s); using the cache folder", libs, exc)
    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for name in (f"{_RTX_LIB}.1", f"{_RTX_PARSER_LIB}.1"):
            _link(libs / name, cache / name)
        _link(real, cache / _RTX_LIB)
    except OSError as exc:
        raise TensorRTUnavailable(
            f"the TensorRT-RTX ONNX parser needs '{_RTX_LIB}' beside '{real}', and neither '{libs}' nor the cache "
            f"folder '{cache}' is writable ({exc.strerror}); run once: ln -s {real.name} {beside}"
        ) from None
    if _RTX_LIBS_PACKAGE in sys.modules or any(m in sys.modules for m in _MODULE_NAMES["tensorrt_rtx"]):
        # Already loaded from the package folder: $ORIGIN of the parser is that folder, so the
        # cache link would not be seen and the parser would abort the process.
        raise TensorRTUnavailable(
            f"TensorRT-RTX was imported before engram_trt could link '{_RTX_LIB}', and '{libs}' is not writable; "
            f"import engram_trt.native.trt_compat first, or run once: ln -s {real.name} {beside}"
        )
    mode = getattr(os, "RTLD_GLOBAL", 0)
    # Load through the cache folder: the loader records that folder as the libraries'
    # $ORIGIN, and the parser's later dlopen("libtensorrt_rtx.so") searches it.
    ctypes.CDLL(str(cache / f"{_RTX_LIB}.1"), mode=mode)
    ctypes.CDLL(str(cache / f"{_RTX_PARSER_LIB}.1"), mode=mode)
    log.info("loaded TensorRT-RTX through %s (the package folder %s is not writable)", cache, libs)
    _rtx_link = cache / _RTX_LIB
    return _rtx_link


def _import(flavour: str) -> TRT | None:
    last: Exception | None = None
    for name in _MODULE_NAMES[flavour]:
        if importlib.util.find_spec(name) is None:
            continue
        if flavour == "tensorrt_rtx":
            ensure_rtx_parser_link()
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # a broken install: report it, do not hide it
            last = exc
            continue
        return TRT(module=mod, flavour=flavour, module_name=name, version=str(getattr(mod, "__version__", "unknown")))
    if last is not None:
        raise TensorRTUnavailable(
            f"the {flavour} module is installed but fails to import ({type(last).__name__}: {last}); reinstall it"
        )
    return None


def load(flavour: str | None = None) -> TRT:
    """Import TensorRT (``tensorrt`` first, then TensorRT-RTX) once and return it.

    ``flavour`` (or ``$ENGRAM_TRT_FLAVOUR``) restricts the choice to one flavour.
    Raises :class:`TensorRTUnavailable` with the install command when none imports.
    """
    global _loaded
    want = flavour or os.environ.get("ENGRAM_TRT_FLAVOUR") or None
    if want is not None and want not in FLAVOURS:
        raise EngramError(
            f"unknown TensorRT flavour {want!r} (expected one of {list(FLAVOURS)}; check ENGRAM_TRT_FLAVOUR)"
        )
    if _loaded is not None and (want is None or _loaded.flavour == want):
        return _loaded
    for f in (want,) if want else FLAVOURS:
        got = _import(f)
        if got is not None:
            _loaded = got
            log.debug("using %s %s (module %s)", got.flavour, got.version, got.module_name)
            return got
    which = want or "tensorrt or tensorrt_rtx"
    raise TensorRTUnavailable(
        f"no TensorRT builder is importable ({which}); install TensorRT-RTX with "
        f"`pip install tensorrt-rtx-cu13-bindings tensorrt-rtx-cu13-libs` or full TensorRT, "
        f"or stop after the exported graph (model.onnx) and build it elsewhere"
    )


def available(flavour: str | None = None) -> bool:
    """True when :func:`load` would succeed (never raises for a missing module)."""
    try:
        load(flavour)
        return True
    except TensorRTUnavailable:
        return False


def module_available(name: str) -> bool:
    """Whether a TensorRT Python module of that import name is installed (for test skips)."""
    return importlib.util.find_spec(name) is not None


def logger(severity: str = "WARNING") -> Any:
    """One shared TensorRT logger (the plugin registry keeps a pointer to the first one).

    TensorRT's stock Python logger prints to stdout, where it would corrupt the JSON a
    command prints; this one hands each message to :mod:`logging` (stderr) at the
    matching level instead.
    """
    global _logger
    t = load().module
    if _logger is None:
        sev = t.Logger.Severity
        levels = {
            sev.INTERNAL_ERROR: logging.CRITICAL,
            sev.ERROR: logging.ERROR,
            sev.WARNING: logging.WARNING,
            sev.INFO: logging.INFO,
            sev.VERBOSE: logging.DEBUG,
        }
        trt_log = logging.getLogger("engram_trt.tensorrt")

        class _Logger(t.ILogger):
            def __init__(self) -> None:
                t.ILogger.__init__(self)
                self.min_severity = getattr(sev, severity)

            def log(self, s: Any, msg: str) -> None:
                if s <= self.min_severity:
                    trt_log.log(levels.get(s, logging.WARNING), "%s", msg)

        _logger = _Logger()
    return _logger


def create_builder() -> Any:
    """A ``Builder`` bound to the shared logger; also makes plugin-load errors visible."""
    t = load().module
    b = t.Builder(logger())
    if not _builders:
        _builders.append(b)
    return b


_loaded_plugin_libs: dict[str, Any] = {}


def load_plugin_library(path: str | Path) -> Any:
    """Load a plugin library into the global registry (once per path) and return its handle.

    A ``Builder(logger)`` is created first: without one the registry has no logger and
    a failed load returns silently, leaving "plugin not found" errors for later.
    """
    p = Path(path).resolve()
    key = str(p)
    if key in _loaded_plugin_libs:
        return _loaded_plugin_libs[key]
    if not p.is_file():
        raise EngramError(
            f"plugin library '{p}' does not exist "
            "(build it with `cmake -S . -B build && cmake --build build`, or set ENGRAM_TRT_PLUGIN_LIB)"
        )
    if not _builders:
        create_builder()
    t = load().module
    handle = t.get_plugin_registry().load_library(key)
    if handle is None:
        raise EngramError(
            f"TensorRT could not load the plugin library '{p}' "
            "(see the TensorRT log above; it must export getCreators and setLoggerFinder)"
        )
    _loaded_plugin_libs[key] = handle
    return handle


def plugin_creator_names() -> list[tuple[str, str]]:
    """``(name, version)`` of every plugin creator the registry knows."""
    t = load().module
    reg = t.get_plugin_registry()
    out: list[tuple[str, str]] = []
    for c in reg.all_creators:
        out.append((str(c.name), str(c.plugin_version)))
    return out


def create_network(builder: Any) -> Any:
    """A strongly typed network: the exported graph's dtypes are the engine's dtypes.

    TensorRT-RTX networks are always strongly typed; full TensorRT needs the flag. Both
    accept it, so this is one call for both.
    """
    t = load().module
    flag = 1 << int(t.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return builder.create_network(flag)


def onnx_parser(network: Any) -> Any:
    """An ONNX parser for ``network`` (the RTX parser's library link is made first)."""
    trt_ = load()
    if trt_.is_rtx:
        ensure_rtx_parser_link()
    return trt_.module.OnnxParser(network, logger())


def parse_onnx_file(parser: Any, path: str | Path) -> None:
    """Parse a model file (external data resolved beside it) or raise with every parser error."""
    ok = parser.parse_from_file(str(path))
    if not ok:
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        first = errors[0].splitlines()[0] if errors else "no error reported"
        raise EngramError(
            f"the TensorRT ONNX parser refused '{path}': {first} "
            f"({len(errors)} error(s); if a custom op is unknown, the plugin library is not loaded)"
        )


def parse_targets(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``'sm80,sm86'`` -> ``('sm80', 'sm86')``, checked against the RTX targets."""
    if text is None:
        return ()
    items: Iterable[str] = text.split(",") if isinstance(text, str) else text
    out: list[str] = []
    for raw in items:
        t = raw.strip().lower()
        if not t:
            continue
        if t.isdigit():
            t = "sm" + t
        if t not in RTX_TARGETS:
            raise EngramError(
                f"--target {raw.strip()!r} is not a TensorRT-RTX compute capability "
                f"(expected a comma-separated list of {', '.join(RTX_TARGETS)})"
            )
        if t not in out:
            out.append(t)
    return tuple(out)


def set_targets(config: Any, targets: Sequence[str]) -> None:
    """Compile an RTX engine for the listed compute capabilities.

    Full TensorRT builds for the GPU it runs on and has no such list; asking it for
    targets is refused rather than ignored, so a user never ships an engine built for
    another GPU than they think.
    """
    if not targets:
        return
    trt_ = load()
    if not trt_.is_rtx:
        raise EngramError(
            "--target is a TensorRT-RTX option; full TensorRT builds for the GPU it runs on "
            "(drop --target, or build with tensorrt_rtx)"
        )
    cc = trt_.module.ComputeCapability
    config.num_compute_capabilities = len(targets)
    for i, t in enumerate(targets):
        config.set_compute_capability(getattr(cc, t.upper()), i)


def enable_aliased_plugin_io(config: Any) -> None:
    """Let plugin outputs alias plugin inputs (``PreviewFeature.ALIASED_PLUGIN_IO_10_03``):
    EngramAttention's cache outputs are its cache inputs, updated in place. Without the
    feature the builder refuses such a plugin ("Aliased I/O used by plugin ... not
    enabled", TensorRT-RTX 1.7.1); TensorRT before 10.3 has no such feature at all."""
    t = load()
    feature = getattr(getattr(t.module, "PreviewFeature", None), "ALIASED_PLUGIN_IO_10_03", None)
    if feature is None:
        raise EngramError(
            f"{t.flavour} {t.version} has no PreviewFeature.ALIASED_PLUGIN_IO_10_03, which the in-place "
            f"KV cache needs; install TensorRT 10.3 or newer, or a TensorRT-RTX that has it (1.7.1 does)"
        )
    config.set_preview_feature(feature, True)


def set_plugins_to_serialize(config: Any, libraries: Sequence[str | Path]) -> None:
    """Embed plugin libraries in the engine (both flavours spell it the same way)."""
    config.plugins_to_serialize = [str(Path(p).resolve()) for p in libraries]


def describe() -> dict[str, str]:
    """``{'flavour', 'module', 'version'}`` of the TensorRT in use (for the manifest)."""
    t = load()
    return {"flavour": t.flavour, "module": t.module_name, "version": t.version}


def create_runtime() -> Any:
    """A ``Runtime`` bound to the shared logger (engine deserialization)."""
    t = load().module
    return t.Runtime(logger())
