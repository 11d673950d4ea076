"""What the GPU tests share (formerly scripts/h200_common.py and the helpers the check
scripts lent each other): the log and the figures, the plugin harness binding, plugin
field builders, random inputs, the gate's tolerances, the fp8 test tables and the
backbone / GEMV comparisons.

A check is a plain ``assert`` whose message holds the measured value and its bound (each
case a parametrized test). ``say`` is the log, ``note`` adds a figure to the module's JSON
(tests/gpu/conftest.py points both at the running test's module for each test); a check
function the CPU suite shares returns ``Checks`` for the caller to assert.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np

# As the package and the CLI do (engram_trt/__init__.py): torch's OpenMP workers must
# not spin on the host gather's cores after the checks' CPU references. Before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
if str(REPO / "python") not in sys.path:  # the working tree's package when it is not installed
    sys.path.insert(0, str(REPO / "python"))

HARNESS_NAME = "libengram_plugin_harness.so"

# --- the log and the figures ----------------------------------------------------------------------

_log: list[str] | None = None
_data: dict | None = None


def say(msg: str) -> None:
    print(msg, flush=True)
    if _log is not None:
        _log.append(msg)


def note(key: str, value: Any) -> None:
    """A figure for the module's JSON (``data``), beside its checks."""
    if _data is not None:
        _data[key] = value


_on_fatal: list[Callable[[], None]] = []


def fatal(msg: str) -> None:
    """End the process now (a CUDA stream that waits forever cannot be released, so the
    process could not exit otherwise), after the results so far are written."""
    say(f"FATAL: {msg}")
    for fn in _on_fatal:
        try:
            fn()
        except Exception:  # noqa: BLE001 - ending anyway
            pass
    sys.stdout.flush()
    os._exit(1)


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` while open (an A/B switch), then
    back to what it was (unset if it was)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def cuda_normal(rng, shape, scale: float = 1.0, dtype: str = "float32") -> Any:
    """Standard normal draws of ``rng`` times ``scale``, made in float32 and put on the GPU
    in ``dtype`` (a torch dtype's name)."""
    import torch

    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to("cuda", getattr(torch, dtype))


def excess(got, ref, bound) -> float:
    """The largest ``|got - ref| - bound`` in float64 on the host (<= 0: within the bound)."""
    return float(((got.double().cpu() - ref.double().cpu()).abs() - bound.double().cpu()).max())


@contextlib.contextmanager
def noting(data: dict | None = None, log: list[str] | None = None) -> Iterator[None]:
    """While open, ``note`` / ``say`` fill ``data`` / ``log`` (a module's figures and log)."""
    global _data, _log
    saved = _data, _log
    _data, _log = data, log
    try:
        yield
    finally:
        _data, _log = saved


class Checks(dict):
    """Named checks ``{name: (ok, detail)}`` that one shared check function (e.g. a module's
    ``check_plugin_cpu``) gathers for several tests: the GPU module runs it once (a
    module-scoped fixture) and asserts each check in a parametrized test of its own; the CPU
    suite calls it and asserts them all."""

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self[name] = (bool(ok), str(detail))

    def failed(self) -> dict[str, str]:
        return {name: detail for name, (ok, detail) in self.items() if not ok}


def run_child(module: str, *args: str, timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess:
    """``python -m gpu.<module> args`` in a child process (a CUDA fault there cannot end
    the test session), with tests/ and the package on its path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(REPO / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return subprocess.run(
        [sys.executable, "-m", f"gpu.{module}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO),
        **kw,
    )


# --- random inputs, the gate's tolerances ------------------------------------------------------


def random_fp8_table(rng, rows: int, head_dim: int, block: int = 32):
    fp8 = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x3C  # no NaN encodings: bit comparison of NaN payloads is meaningless
    scales = rng.integers(100, 150, size=(rows, head_dim // block), dtype=np.uint8)
    return fp8, scales


def gate_inputs(rng, T, hc, D, wdtype, mdtype, io=None):
    import torch

    io = torch.bfloat16 if io is None else io
    hidden = torch.from_numpy(rng.standard_normal((T, hc, D)).astype(np.float32)).to(io)
    kv = torch.from_numpy(rng.standard_normal((T, (hc + 1) * D)).astype(np.float32)).to(io)
    qw = torch.from_numpy((1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)).to(wdtype)
    kw = torch.from_numpy((1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)).to(wdtype)
    mask_np = rng.random(T) > 0.2
    mask = torch.from_numpy(mask_np.astype(np.int32)).to(mdtype)
    return hidden, kv, qw, kw, mask, mask_np


def bits(t):
    """The tensor's raw bits on the CPU (a bitwise comparison, NaN payloads included)."""
    import torch

    return t.cpu().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def gate_bound(io, ref):
    """Allowed |out - ref| per element for the I/O dtype (test_verify.py's docstring)."""
    import torch

    if io == torch.bfloat16:
        return 2.0**-8 * np.abs(ref) + 1e-5
    if io == torch.float16:
        return 2.0**-10 * np.abs(ref) + 1e-4
    return np.full(ref.shape, 1e-5 * float(np.nanmax(np.abs(ref))))  # NaN cases: the finite maximum


def gate_ok(out, hidden, kv, qw, kw, mask_np, eps, reference) -> tuple[bool, str]:
    import torch

    ref = reference(hidden.float().numpy(), kv.float().numpy(), qw.float().numpy(), kw.float().numpy(), mask_np, eps)
    got = out.float().cpu().numpy().astype(np.float64)
    err = np.abs(got - ref)
    bound = gate_bound(hidden.dtype, ref)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    dead = ~torch.from_numpy(mask_np)
    masked_exact = out.dtype == hidden.dtype and torch.equal(bits(out)[dead], bits(hidden)[dead])
    ok = bool(np.all(err <= bound)) and np.isfinite(got).all() and masked_exact
    return (
        ok,
        f"max|err|={err.max():.3g} rel-norm={rel:.3g} worst err/bound={float((err / bound).max()):.3f} "
        f"masked-exact={masked_exact}",
    )


def dtype_name(dtype) -> str:
    return str(dtype)[6:]


# --- the plugin harness (plugins/tests, built beside the library) -------------------------------

PF_FLOAT32, PF_INT32, PF_CHAR, PF_INT64 = 1, 5, 6, 10
DT = {"float32": 0, "float16": 1, "int32": 3, "bool": 4, "bfloat16": 7, "int64": 8}


def harness_path(build_dir: Path) -> Path:
    return Path(build_dir) / "plugins" / "tests" / HARNESS_NAME


class Harness:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        vp, i32 = ctypes.c_void_p, ctypes.c_int32
        self.lib.harness_last_error.restype = ctypes.c_char_p
        self.lib.harness_create.restype = vp
        self.lib.harness_create.argtypes = [
            ctypes.c_char_p,
            i32,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            ctypes.POINTER(vp),
            i32,
        ]
        self.lib.harness_roundtrip.restype = vp
        self.lib.harness_roundtrip.argtypes = [vp]
        self.lib.harness_destroy.argtypes = [vp]
        self.lib.harness_serialized_int.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]
        self.lib.harness_serialized_field.argtypes = [
            vp,
            i32,
            ctypes.POINTER(i32),
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            vp,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_uint64),
        ]
        self.lib.harness_output_types.argtypes = [vp, i32, ctypes.POINTER(i32), i32, ctypes.POINTER(i32)]
        self.lib.harness_output_shapes.argtypes = [
            vp,
            i32,
            ctypes.POINTER(i32),
            ctypes.POINTER(ctypes.c_int64),
            i32,
            ctypes.POINTER(i32),
            ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(i32),
        ]
        self.lib.harness_run.argtypes = [
            vp,
            i32,
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(vp),
            i32,
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(vp),
            vp,
            ctypes.POINTER(ctypes.c_uint64),
        ]
        self.lib.harness_aliased_input.argtypes = [vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32)]

    def error(self) -> str:
        return self.lib.harness_last_error().decode()

    def create(self, name: str, fields: list[tuple[str, int, np.ndarray]], phase: int = 0) -> int:
        n = len(fields)
        names = (ctypes.c_char_p * n)(*[f[0].encode() for f in fields])
        types = (ctypes.c_int32 * n)(*[f[1] for f in fields])
        lengths = (ctypes.c_int32 * n)(*[int(f[2].size) for f in fields])
        data = (ctypes.c_void_p * n)(*[f[2].ctypes.data for f in fields])
        h = self.lib.harness_create(name.encode(), n, names, types, lengths, data, phase)
        if not h:
            raise RuntimeError(f"harness_create({name}): {self.error()}")
        return h

    def roundtrip(self, h: int) -> int:
        h2 = self.lib.harness_roundtrip(h)
        if not h2:
            raise RuntimeError(f"harness_roundtrip: {self.error()}")
        return h2

    def serialized_int(self, h: int, name: str) -> int:
        """A scalar integer field of the plugin's getFieldsToSerialize (what an engine stores)."""
        value = ctypes.c_int64(0)
        if self.lib.harness_serialized_int(h, name.encode(), ctypes.byref(value)) != 0:
            raise RuntimeError(f"serialized_int({name}): {self.error()}")
        return value.value

    def serialized_fields(self, h: int) -> list[tuple[str, int, int, bytes]]:
        """Every field of the plugin's getFieldsToSerialize as (name, PluginFieldType, length,
        bytes): what TensorRT writes into an engine."""
        fields, count, index = [], ctypes.c_int32(1), 0
        while index < count.value:
            name, ftype, length = ctypes.c_char_p(), ctypes.c_int32(), ctypes.c_int32()
            buf, size = ctypes.create_string_buffer(1 << 16), ctypes.c_uint64(0)
            if (
                self.lib.harness_serialized_field(
                    h,
                    index,
                    ctypes.byref(count),
                    ctypes.byref(name),
                    ctypes.byref(ftype),
                    ctypes.byref(length),
                    buf,
                    len(buf),
                    ctypes.byref(size),
                )
                != 0
            ):
                raise RuntimeError(f"serialized_fields: {self.error()}")
            if index < count.value:
                fields.append((name.value.decode(), ftype.value, length.value, buf.raw[: size.value]))
            index += 1
        return fields

    def output_types(self, h: int, in_types: list[int]) -> list[int]:
        return self.outputs_types(h, in_types, 1)

    def outputs_types(self, h: int, in_types: list[int], n_out: int) -> list[int]:
        out = (ctypes.c_int32 * n_out)()
        if (
            self.lib.harness_output_types(h, len(in_types), (ctypes.c_int32 * len(in_types))(*in_types), n_out, out)
            != 0
        ):
            raise RuntimeError(f"output_types: {self.error()}")
        return list(out)

    @staticmethod
    def _dims(shapes):
        nb = (ctypes.c_int32 * len(shapes))(*[len(s) for s in shapes])
        flat = (ctypes.c_int64 * (8 * len(shapes)))()
        for i, s in enumerate(shapes):
            for k, v in enumerate(s):
                flat[8 * i + k] = v
        return nb, flat

    def _shapes(self, h: int, in_shapes: list[tuple], n_out: int) -> list[tuple[tuple, tuple]]:
        """Per output (its dims, which of them are build-time constants)."""
        nb, flat = self._dims(in_shapes)
        onb, odims, oconst = (
            (ctypes.c_int32 * n_out)(),
            (ctypes.c_int64 * (8 * n_out))(),
            (ctypes.c_int32 * (8 * n_out))(),
        )
        if self.lib.harness_output_shapes(h, len(in_shapes), nb, flat, n_out, onb, odims, oconst) != 0:
            raise RuntimeError(f"output_shapes: {self.error()}")
        return [
            (tuple(odims[8 * o + k] for k in range(onb[o])), tuple(bool(oconst[8 * o + k]) for k in range(onb[o])))
            for o in range(n_out)
        ]

    def output_shapes(self, h: int, in_shapes: list[tuple]) -> tuple[tuple, tuple]:
        return self._shapes(h, in_shapes, 1)[0]

    def outputs_shapes(self, h: int, in_shapes: list[tuple], n_out: int) -> list[tuple]:
        return [dims for dims, _ in self._shapes(h, in_shapes, n_out)]

    def aliased_input(self, h: int, output: int) -> tuple[int, int]:
        """(the input an output aliases or -1, the plugin's build capability major)."""
        aliased, major = ctypes.c_int32(-7), ctypes.c_int32(0)
        if self.lib.harness_aliased_input(h, output, ctypes.byref(aliased), ctypes.byref(major)):
            raise RuntimeError(f"aliased_input: {self.error()}")
        return aliased.value, major.value

    def run(self, h: int, inputs: list, in_types: list[int], out, out_type: int, stream: int) -> int:
        return self.run_outputs(h, inputs, in_types, [out], [out_type], stream)

    def run_outputs(
        self, h: int, inputs: list, in_types: list[int], outputs: list, out_types: list[int], stream: int
    ) -> int:
        nb, flat = self._dims([tuple(t.shape) for t in inputs])
        onb, oflat = self._dims([tuple(t.shape) for t in outputs])
        ptrs = (ctypes.c_void_p * len(inputs))(*[t.data_ptr() for t in inputs])
        optrs = (ctypes.c_void_p * len(outputs))(*[t.data_ptr() for t in outputs])
        ws = ctypes.c_uint64(0)
        status = self.lib.harness_run(
            h,
            len(inputs),
            (ctypes.c_int32 * len(inputs))(*in_types),
            nb,
            flat,
            ptrs,
            len(outputs),
            (ctypes.c_int32 * len(outputs))(*out_types),
            onb,
            oflat,
            optrs,
            ctypes.c_void_p(stream),
            ctypes.byref(ws),
        )
        if status != 0:
            raise RuntimeError(f"harness_run: {self.error()}")
        return ws.value


def hash_fields(layout):
    return [
        ("n_layers", PF_INT32, np.array([layout.num_layers], np.int32)),
        ("max_ngram_size", PF_INT32, np.array([layout.max_ngram_size], np.int32)),
        ("n_heads", PF_INT32, np.array([layout.n_heads], np.int32)),
        ("pad_id", PF_INT64, np.array([layout.pad_id], np.int64)),
        ("compressed_vocab_size", PF_INT64, np.array([layout.compressed_vocab_size], np.int64)),
        ("primes", PF_INT64, np.ascontiguousarray(layout.primes.reshape(-1), np.int64)),
        ("offsets", PF_INT64, np.ascontiguousarray(layout.offsets.reshape(-1), np.int64)),
        ("multipliers", PF_INT64, np.ascontiguousarray(layout.multipliers.reshape(-1), np.int64)),
    ]


def hash_fields_text(layout):
    """The ONNX form: int64 arrays as comma-separated decimal text (kCHAR)."""
    text = {
        name: np.frombuffer(",".join(str(int(v)) for v in arr.reshape(-1)).encode(), dtype=np.uint8)
        for name, arr in (("primes", layout.primes), ("offsets", layout.offsets), ("multipliers", layout.multipliers))
    }
    return [f if f[0] not in text else (f[0], PF_CHAR, text[f[0]]) for f in hash_fields(layout)]


def gather_fields(layer, L, cols, head_dim, dtype_code, block, rows):
    return [
        ("layer_index", PF_INT32, np.array([layer], np.int32)),
        ("n_layers", PF_INT32, np.array([L], np.int32)),
        ("n_cols", PF_INT32, np.array([cols], np.int32)),
        ("head_dim", PF_INT32, np.array([head_dim], np.int32)),
        ("table_dtype", PF_INT32, np.array([dtype_code], np.int32)),
        ("quant_block", PF_INT32, np.array([block], np.int32)),
        ("num_rows", PF_INT64, np.array([rows], np.int64)),
    ]


def column_range_fields(column_begin, column_end, row_offset):
    """EngramGather's optional fields of a tensor-parallel rank: its columns and the global
    row id of its table slice's first row."""
    return [
        ("column_begin", PF_INT32, np.array([column_begin], np.int32)),
        ("column_end", PF_INT32, np.array([column_end], np.int32)),
        ("row_offset", PF_INT64, np.array([row_offset], np.int64)),
    ]


def counted_gather_fields(layer, L, cols, head_dim, dtype_code, block, rows):
    """EngramGather fields with the optional bad-row counter input enabled."""
    return gather_fields(layer, L, cols, head_dim, dtype_code, block, rows) + [
        ("bad_rows_input", PF_INT32, np.array([1], np.int32))
    ]


def gate_fields(hc, D, eps):
    return [
        ("hc_mult", PF_INT32, np.array([hc], np.int32)),
        ("hidden_size", PF_INT32, np.array([D], np.int32)),
        ("eps", PF_FLOAT32, np.array([eps], np.float32)),
    ]


# --- fp8 test tables (host gather, cache, driver, job buffers) ----------------------------------


def fp8_table(rng: Any, rows: int, head_dim: int = 256, quant_block: int = 32) -> tuple[Any, Any, Any, Any]:
    """A random fp8 table: (values, scales) as NumPy and as CPU tensors. No value byte is
    a NaN code (0x7F / 0xFF), so bitwise comparisons of dequantized rows stay meaningful."""
    import torch

    values = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    values[(values & 0x7F) == 0x7F] = 0x3C
    scales = rng.integers(110, 140, size=(rows, head_dim // quant_block), dtype=np.uint8)
    return values, scales, torch.from_numpy(values), torch.from_numpy(scales)


def fp8_test_table(rng: np.random.Generator, N: int = 200_000, D: int = 256, QB: int = 32) -> SimpleNamespace:
    """The host gather checks' fp8 table of N rows: ``values``, ``scales`` (NumPy),
    ``rows_t``, ``scales_t``, ``inline_t`` (CPU tensors), ``N``, ``D``, ``QB``, with
    ``ref_fp8(ids)`` (the float32 NumPy dequant, zero rows for ids off the table) and
    ``same(a, b)`` (bit equality). Shared by test_hostgather, test_driver, test_jobstaging."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows
    from engram_trt.runtime.gatherpath import inline_table

    values, scales, rows_t, scales_t = fp8_table(rng, N, D, QB)

    def ref_fp8(ids: np.ndarray) -> torch.Tensor:
        ok = (ids >= 0) & (ids < N)
        safe = np.where(ok, ids, 0)
        ref = dequant_fp8_rows(values[safe], scales[safe], QB)
        ref[~ok] = 0
        return torch.from_numpy(ref).to(torch.bfloat16)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))

    return SimpleNamespace(
        values=values,
        scales=scales,
        rows_t=rows_t,
        scales_t=scales_t,
        inline_t=inline_table(rows_t, scales_t),
        N=N,
        D=D,
        QB=QB,
        ref_fp8=ref_fp8,
        same=same,
    )


# --- bf16 comparisons (backbone kernels, GEMV) --------------------------------------------------

U = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest even)


def ulp_distance(a, b):
    """Per element, how many bf16 values lie between a and b (0: the same bits; +0 = -0)."""
    import torch

    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        mag = i & 0x7FFF
        return torch.where(i < 0, -mag, mag)

    return (ordered(a) - ordered(b)).abs()


def versus_torch(got, want, exact: bool = False) -> tuple[bool, str]:
    """The kernel's bf16 output against the PyTorch ops' (<= 1 ulp, <= 1% differing; exact:
    bit for bit)."""
    d = ulp_distance(got, want)
    worst = int(d.max()) if d.numel() else 0
    differing = float((d > 0).float().mean()) if d.numel() else 0.0
    ok = worst == 0 if exact else (worst <= 1 and differing <= 0.01)
    return ok, f"vs torch ops: max {worst} ulp, {differing:.2e} of elements differ"


def within(got, ref, bound) -> tuple[bool, str]:
    """|got - ref| <= bound everywhere (got bf16, ref / bound float64 tensors)."""
    import torch

    g = got.double()
    err = (g - ref).abs()
    finite = bool(torch.isfinite(g).all())
    ratio = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    return finite and bool(
        (err <= bound).all()
    ), f"vs float64: max|err|={float(err.max()) if err.numel() else 0:.3g} worst err/bound={ratio:.3f}"


def combined(*results: tuple[bool, str]) -> tuple[bool, str]:
    """Several comparisons (each ``(ok, detail)``) as one: whether all held, their details."""
    return all(r[0] for r in results), "; ".join(r[1] for r in results)


# --- float tables and the tiny committed checkpoints ---------------------------------------


def special_float_table(torch: Any, dtype: Any, rows: int, width: int, seed: int, inf_column: int) -> Any:
    """[rows, width] random rows of ``dtype`` holding special values, for bit-exact gathers:
    f32 rows whose low halves are bf16 NaN (with a payload) / +inf bit patterns (any
    conversion would show); f16 / bf16 NaN in column 0 and inf in ``inf_column``."""
    gen = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    if dtype == torch.float32:
        bits = t.view(torch.int32)
        bits[::7, ::3] = (bits[::7, ::3] & ~0xFFFF) | 0x7FC1  # low half: a bf16 NaN with a payload
        bits[1::7, 1::3] = (bits[1::7, 1::3] & ~0xFFFF) | 0x7F80  # low half: bf16 +inf
    else:
        t[::11, 0] = float("nan")
        t[1::13, inf_column] = float("inf")
    return t


def load_checkpoint(folder: Path, device: Any, dtype: Any) -> tuple[Any, Any]:
    """The checkpoint folder opened and its model loaded on ``device`` in ``dtype``:
    (checkpoint, model); the caller closes the checkpoint."""
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(folder)
    return ckpt, ckpt.architecture.load_model(ckpt, device=device, dtype=dtype)


@contextlib.contextmanager
def fp32_cpu_and_bf16_cuda(folder: Path) -> Iterator[tuple[Any, Any]]:
    """A tiny committed checkpoint (tests/data) loaded twice while open: (the fp32 CPU
    model, the bf16 CUDA model)."""
    import torch

    ckpt_c, cpu = load_checkpoint(folder, "cpu", torch.float32)
    ckpt_g, gpu = load_checkpoint(folder, "cuda", torch.bfloat16)
    try:
        yield cpu, gpu
    finally:
        ckpt_c.close()
        ckpt_g.close()


def check_bf16_cuda_logits_near_fp32_cpu(models: tuple[Any, Any], expected: dict, i: int) -> None:
    """Prompt ``i`` of a tiny committed checkpoint's expected.json (``models``: from
    fp32_cpu_and_bf16_cuda): the bf16 CUDA model's prefill logits within 3x transformers'
    own recorded bf16-vs-fp32 distance of the fp32 CPU model's; an assert and a figure."""
    import torch

    from .cases import rel_err
    from engram_trt.models.step import PackedStep

    cpu, gpu = models
    prompt = expected["prompts"][i]
    step = lambda: PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0])  # noqa: E731
    ref = cpu.forward_step(step(), cpu.new_cache(1, 64), all_logits=True)
    got = gpu.forward_step(step(), gpu.new_cache(1, 64), all_logits=True)
    err = rel_err(got, ref)
    bound = 3 * expected["transformers_bf16_rel_l2"][i]
    note(f"bf16_rel_l2_prompt{i}", err)
    assert err <= bound, (
        f"prompt {i}: bf16 CUDA logits within 3x transformers' bf16 round-off of fp32 CPU: "
        f"rel L2 {err:.2e}, bound {bound:.2e}"
    )


def llm_on_cuda_tokens(folder: Path, expected: dict) -> tuple[list[list[int]], str]:
    """A tiny committed checkpoint through ``engram_trt.LLM`` on CUDA (torch backend, fp32,
    the prompts batched): (each prompt's greedy tokens, the backend's label)."""
    from engram_trt import LLM, SamplingParams

    with LLM(str(folder), backend="torch", device="cuda", dtype="fp32") as llm:
        outs = llm.generate(
            expected["prompts"], SamplingParams(max_tokens=expected["new_tokens"], temperature=0.0, ignore_eos=True)
        )
        label = llm.runner.backend.label
    return [list(o.outputs[0].token_ids) for o in outs], label


def check_llm_on_cuda_gives_the_recorded_tokens(run: tuple[list[list[int]], str], expected: dict, i: int) -> None:
    """Prompt ``i`` of the batch ``run`` (llm_on_cuda_tokens) gives the recorded greedy tokens."""
    got, label = run
    assert got[i] == expected["greedy"][i], (
        f"LLM on CUDA: prompt {i}: recorded greedy tokens: {got[i]} vs {expected['greedy'][i]}; backend {label}"
    )
