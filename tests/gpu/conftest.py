"""The GPU tests' frame: every test under tests/gpu is marked ``gpu`` and skipped with
the reason "no CUDA device" where torch sees none (CI), and a test marked ``gpus2`` (several
GPUs of one node) with "needs 2 CUDA devices" where it sees fewer. A test's checks are plain
``assert``s (each case a parametrized test); pass / fail is pytest's own (run_h200.sh's
summary comes from the JUnit XML: tests/gpu/summary.py). The figures a test notes
(``helpers.note``) land in ``$ENGRAM_TRT_GPU_OUT/<module>.json`` (default: a temporary
folder) with each test's outcome, and ``summary.json`` beside them.

Fixtures: ``build_dir`` (the plugin library: ``$ENGRAM_TRT_PLUGIN_LIB``'s folder, or a
CMake build for ``$ENGRAM_TRT_CUDA_ARCHS`` (default 90) in ``$ENGRAM_TRT_GPU_BUILD``
(default build-h200/), made when it holds no library), ``trt_include`` (the TensorRT
headers: ``$TENSORRT_INCLUDE_DIR``, .device/trt_include, or the kernel-lens wheel's),
``harness``, ``gpu_out``, ``gpu_seed`` (``$ENGRAM_TRT_GPU_SEED`` or fresh), a per-test
``rng`` and ``dev``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from . import helpers

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NO_CUDA = "no CUDA device"
NO_TWO_GPUS = "needs 2 CUDA devices"  # tests marked gpus2 (several GPUs of one node)


def _is_gpu_item(item: pytest.Item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


_cuda: bool | None = None


def cuda_available() -> bool:
    global _cuda
    if _cuda is None:
        try:
            import torch

            _cuda = bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - no usable torch: no CUDA device either
            _cuda = False
    return _cuda


def cuda_device_count() -> int:
    if not cuda_available():
        return 0
    import torch

    return int(torch.cuda.device_count())


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if _is_gpu_item(item)]
    if not gpu_items:
        return
    skip = None if cuda_available() else pytest.mark.skip(reason=NO_CUDA)
    two = pytest.mark.skip(reason=NO_TWO_GPUS) if skip is None and cuda_device_count() < 2 else skip
    for item in gpu_items:
        item.add_marker(pytest.mark.gpu)
        several = item.get_closest_marker("gpus2") is not None
        if (two if several else skip) is not None:
            item.add_marker(two if several else skip)


# --- results: per module, written at the session's end ---------------------------------------

_MODULES: dict[str, dict] = {}


def _module_results(item: pytest.Item) -> dict:
    name = Path(str(item.fspath)).stem
    return _MODULES.setdefault(name, {"module": name, "tests": {}, "data": {}, "log": []})


@pytest.fixture(autouse=True)
def _gpu_figures(request: pytest.FixtureRequest):
    """For one test: ``note`` fills its module's figures and ``say`` its module's log."""
    if not _is_gpu_item(request.node):
        yield
        return
    mod = _module_results(request.node)
    with helpers.noting(mod["data"], mod["log"]):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if _is_gpu_item(item):
        tests = _module_results(item)["tests"]
        name = item.nodeid.split("::", 1)[-1]
        if report.when == "call" or report.outcome != "passed":
            tests[name] = report.outcome if report.when == "call" else f"{report.outcome} ({report.when})"


def _out_dir(config: pytest.Config) -> Path | None:
    env = os.environ.get("ENGRAM_TRT_GPU_OUT")
    return Path(env) if env else getattr(config, "_engram_gpu_tmp_out", None)


def pytest_configure(config: pytest.Config) -> None:
    helpers._on_fatal.append(lambda: _write_results(config))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_results(session.config)


def _write_results(config: pytest.Config) -> None:
    ran = {k: v for k, v in _MODULES.items() if any(not o.startswith("skipped") for o in v["tests"].values())}
    if not ran:
        return
    out = _out_dir(config)
    if out is None:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="engram-trt-gpu-out-"))
    out.mkdir(parents=True, exist_ok=True)
    summary = {"seed": _SEED.get("seed"), "device": _SEED.get("device"), "modules": {}}
    for name, mod in sorted(ran.items()):
        mod["seed"] = _SEED.get("seed")
        (out / f"{name}.json").write_text(json.dumps(mod, indent=1, default=str))
        outcomes = list(mod["tests"].values())
        summary["modules"][name] = {
            "tests_passed": outcomes.count("passed"),
            "tests_not_passed": sum(o != "passed" and not o.startswith("skipped") for o in outcomes),
            "tests": mod["tests"],
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    config._engram_gpu_summary = (out, summary)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    got = getattr(config, "_engram_gpu_summary", None)
    if got is None:
        return
    out, summary = got
    tr = terminalreporter
    tr.section("GPU tests per module")
    for name, m in summary["modules"].items():
        bad = [t for t, o in m["tests"].items() if o != "passed" and not o.startswith("skipped")]
        tr.line(
            f"{name:<28} {m['tests_passed']:4d} tests passed, {m['tests_not_passed']} not"
            + (f"; not passed: {', '.join(t + ' (' + m['tests'][t] + ')' for t in bad)}" if bad else "")
        )
    tr.line(f"seed {summary['seed']}; JSON in {out}")


# --- fixtures ------------------------------------------------------------------------------------

_SEED: dict = {}


@pytest.fixture(scope="session")
def gpu_seed() -> int:
    """The run's seed: ``$ENGRAM_TRT_GPU_SEED`` or fresh randomness (printed, in the JSON)."""
    env = os.environ.get("ENGRAM_TRT_GPU_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    _SEED["seed"] = seed
    try:
        import torch

        _SEED["device"] = torch.cuda.get_device_name()
        _SEED["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    print(f"GPU tests: seed {seed} (ENGRAM_TRT_GPU_SEED={seed} repeats it)")
    return seed


@pytest.fixture
def rng(gpu_seed: int, request: pytest.FixtureRequest):
    """A NumPy generator of its own per test: the run's seed and the test's id."""
    import numpy as np

    return np.random.default_rng([gpu_seed, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def test_seed(gpu_seed: int, request: pytest.FixtureRequest) -> int:
    """An integer seed of the test's own (for torch generators)."""
    return (gpu_seed ^ zlib.crc32(request.node.nodeid.encode())) & 0x7FFF_FFFF


@pytest.fixture
def gen(test_seed: int) -> Any:
    """A CUDA torch generator seeded with the test's own seed."""
    import torch

    return torch.Generator(device="cuda").manual_seed(test_seed)


@pytest.fixture(scope="session")
def gpu_out(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Where the modules' JSON (and any other output) goes: ``$ENGRAM_TRT_GPU_OUT`` or a
    temporary folder."""
    env = os.environ.get("ENGRAM_TRT_GPU_OUT")
    out = Path(env) if env else tmp_path_factory.mktemp("gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    request.config._engram_gpu_tmp_out = out
    return out


@pytest.fixture(scope="session")
def trt_include() -> Path | None:
    """TensorRT headers for the build: ``$TENSORRT_INCLUDE_DIR``, .device/trt_include (what
    the device runs carry), else the kernel-lens wheel's, else None (CMake's own lookup)."""
    for cand in (os.environ.get("TENSORRT_INCLUDE_DIR"), REPO / ".device" / "trt_include"):
        if cand and (Path(cand) / "NvInferRuntime.h").is_file():
            return Path(cand)
    try:
        import importlib.util

        spec = importlib.util.find_spec("kernel_lens")
        if spec and spec.origin:
            path = Path(spec.origin).parent / "include" / "tensorrt"
            if (path / "NvInferRuntime.h").is_file():
                return path
    except (ImportError, ValueError):
        pass
    return None


@pytest.fixture(scope="session", autouse=True)
def build_dir(request: pytest.FixtureRequest, trt_include: Path | None) -> Path:
    """The folder of libengram_trt_plugins.so and the plugin harness (plugins/tests/):
    ``$ENGRAM_TRT_PLUGIN_LIB``'s, or a CMake build (library and harness) for
    ``$ENGRAM_TRT_CUDA_ARCHS`` (default 90) in ``$ENGRAM_TRT_GPU_BUILD`` (default
    build-h200/), configured and built when it holds no library. Exports
    ENGRAM_TRT_PLUGIN_LIB for the session."""
    lib_env = os.environ.get("ENGRAM_TRT_PLUGIN_LIB")
    if lib_env and Path(lib_env).is_file():
        return Path(lib_env).resolve().parent
    build = Path(os.environ.get("ENGRAM_TRT_GPU_BUILD", REPO / "build-h200")).resolve()
    lib = build / "libengram_trt_plugins.so"
    if not lib.is_file() or not helpers.harness_path(build).is_file():
        cmd = [
            "cmake",
            "-S",
            str(REPO),
            "-B",
            str(build),
            f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('ENGRAM_TRT_CUDA_ARCHS', '90')}",
            "-DENGRAM_TRT_BUILD_HARNESS=ON",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if trt_include is not None:
            cmd.append(f"-DTENSORRT_INCLUDE_DIR={trt_include}")
        t0 = time.time()
        for c in (cmd, ["cmake", "--build", str(build), f"-j{os.cpu_count() or 2}"]):
            proc = subprocess.run(c, capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.exit(f"build failed: {' '.join(c)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}", returncode=3)
        print(f"built {lib} in {time.time() - t0:.1f} s")
    os.environ["ENGRAM_TRT_PLUGIN_LIB"] = str(lib)
    return build


@pytest.fixture(scope="session")
def harness(build_dir: Path) -> helpers.Harness:
    return helpers.Harness(helpers.harness_path(build_dir))


@pytest.fixture(scope="session")
def tab(gpu_seed: int):
    """The host gather tests' fp8 table (200,000 rows of 256 bytes, 8 scale bytes; helpers.
    fp8_test_table): test_hostgather, test_driver and test_jobstaging take it."""
    import numpy as np

    return helpers.fp8_test_table(np.random.default_rng([gpu_seed, 11]))


@pytest.fixture(scope="session")
def dev(gpu_seed: int):
    import torch

    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def _session_seed(gpu_seed: int, gpu_out: Path) -> None:
    """Every GPU test pins the run's seed and output folder (for the JSON)."""
