"""What the H200 check scripts share: the log and results, the plugin harness binding,
plugin field builders, random inputs and the gate's tolerances (scripts/h200_verify.py
runs everything; this module only holds the pieces)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from pathlib import Path

import numpy as np

# As the package and the CLI do (engram_trt/__init__.py): torch's OpenMP workers must
# not spin on the host gather's cores after the checks' CPU references. Before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]

LOG: list[str] = []
RESULTS: dict = {"checks": [], "timing": {}}


def say(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def record(name: str, ok: bool, detail: str = "") -> None:
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    say(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")


def record_crash(exc: BaseException) -> None:
    """A check script stopped by an exception: its traceback in the log and a failed
    check, so what ran before it is still reported."""
    import traceback

    say(traceback.format_exc())
    record("script completed", False, f"{type(exc).__name__}: {exc}")


def write_results(out: Path, name: str, seed: int) -> int:
    """``<out>/<name>.json`` (RESULTS) and ``<name>.log``, the pass/fail count and each
    failed check; returns the number failed."""
    import json

    n_fail = sum(not c["ok"] for c in RESULTS["checks"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out / f"{name}.log").write_text("\n".join(LOG) + "\n")
    say(f"\n{len(RESULTS['checks']) - n_fail} checks passed, {n_fail} failed (seed {seed})")
    for c in RESULTS["checks"]:
        if not c["ok"]:
            say(f"  FAILED: {c['name']}: {c['detail'][:200]}")
    return n_fail


def run_checks(body, out: Path, name: str, seed: int, summary=None) -> int:
    """A check script's run after :func:`start`: ``body()`` (its stages); an exception
    stops it but is reported as a failed check, so what ran before it still is; then the
    results are written (:func:`write_results`) and ``summary()``, if given, prints the
    script's tables. Returns the exit status: 1 on any failed check."""
    failed = False
    try:
        body()
    except Exception as exc:  # report what ran, then fail
        record_crash(exc)
        failed = True
    n_fail = write_results(out, name, seed)
    if summary is not None:
        summary()
    return 1 if (n_fail or failed) else 0


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
    """Allowed |out - ref| per element for the I/O dtype (scripts/h200_verify.py's docstring)."""
    import torch

    if io == torch.bfloat16:
        return 2.0 ** -8 * np.abs(ref) + 1e-5
    if io == torch.float16:
        return 2.0 ** -10 * np.abs(ref) + 1e-4
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
    return ok, f"max|err|={err.max():.3g} rel-norm={rel:.3g} worst err/bound={float((err / bound).max()):.3f} masked-exact={masked_exact}"


def dtype_name(dtype) -> str:
    return str(dtype)[6:]


PF_FLOAT32, PF_INT32, PF_CHAR, PF_INT64 = 1, 5, 6, 10
DT = {"float32": 0, "float16": 1, "int32": 3, "bool": 4, "bfloat16": 7, "int64": 8}


class Harness:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        vp, i32 = ctypes.c_void_p, ctypes.c_int32
        self.lib.harness_last_error.restype = ctypes.c_char_p
        self.lib.harness_create.restype = vp
        self.lib.harness_create.argtypes = [ctypes.c_char_p, i32, ctypes.POINTER(ctypes.c_char_p),
                                            ctypes.POINTER(i32), ctypes.POINTER(i32), ctypes.POINTER(vp), i32]
        self.lib.harness_roundtrip.restype = vp
        self.lib.harness_roundtrip.argtypes = [vp]
        self.lib.harness_destroy.argtypes = [vp]
        self.lib.harness_serialized_int.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]
        self.lib.harness_serialized_field.argtypes = [vp, i32, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_char_p),
                                                      ctypes.POINTER(i32), ctypes.POINTER(i32), vp, ctypes.c_uint64,
                                                      ctypes.POINTER(ctypes.c_uint64)]
        self.lib.harness_output_types.argtypes = [vp, i32, ctypes.POINTER(i32), i32, ctypes.POINTER(i32)]
        self.lib.harness_output_shapes.argtypes = [vp, i32, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_int64), i32,
                                                   ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(i32)]
        self.lib.harness_run.argtypes = [vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32),
                                         ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(vp), i32, ctypes.POINTER(i32),
                                         ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(vp), vp,
                                         ctypes.POINTER(ctypes.c_uint64)]
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
            if self.lib.harness_serialized_field(h, index, ctypes.byref(count), ctypes.byref(name), ctypes.byref(ftype),
                                                 ctypes.byref(length), buf, len(buf), ctypes.byref(size)) != 0:
                raise RuntimeError(f"serialized_fields: {self.error()}")
            if index < count.value:
                fields.append((name.value.decode(), ftype.value, length.value, buf.raw[:size.value]))
            index += 1
        return fields

    def output_types(self, h: int, in_types: list[int]) -> list[int]:
        return self.outputs_types(h, in_types, 1)

    def outputs_types(self, h: int, in_types: list[int], n_out: int) -> list[int]:
        out = (ctypes.c_int32 * n_out)()
        if self.lib.harness_output_types(h, len(in_types), (ctypes.c_int32 * len(in_types))(*in_types), n_out, out) != 0:
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
        onb, odims, oconst = (ctypes.c_int32 * n_out)(), (ctypes.c_int64 * (8 * n_out))(), (ctypes.c_int32 * (8 * n_out))()
        if self.lib.harness_output_shapes(h, len(in_shapes), nb, flat, n_out, onb, odims, oconst) != 0:
            raise RuntimeError(f"output_shapes: {self.error()}")
        return [(tuple(odims[8 * o + k] for k in range(onb[o])), tuple(bool(oconst[8 * o + k]) for k in range(onb[o])))
                for o in range(n_out)]

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

    def run_outputs(self, h: int, inputs: list, in_types: list[int], outputs: list, out_types: list[int],
                    stream: int) -> int:
        nb, flat = self._dims([tuple(t.shape) for t in inputs])
        onb, oflat = self._dims([tuple(t.shape) for t in outputs])
        ptrs = (ctypes.c_void_p * len(inputs))(*[t.data_ptr() for t in inputs])
        optrs = (ctypes.c_void_p * len(outputs))(*[t.data_ptr() for t in outputs])
        ws = ctypes.c_uint64(0)
        status = self.lib.harness_run(h, len(inputs), (ctypes.c_int32 * len(inputs))(*in_types), nb, flat, ptrs,
                                      len(outputs), (ctypes.c_int32 * len(outputs))(*out_types), onb, oflat, optrs,
                                      ctypes.c_void_p(stream), ctypes.byref(ws))
        if status != 0:
            raise RuntimeError(f"harness_run: {self.error()}")
        return ws.value


def hash_fields(layout):
    return [("n_layers", PF_INT32, np.array([layout.num_layers], np.int32)),
            ("max_ngram_size", PF_INT32, np.array([layout.max_ngram_size], np.int32)),
            ("n_heads", PF_INT32, np.array([layout.n_heads], np.int32)),
            ("pad_id", PF_INT64, np.array([layout.pad_id], np.int64)),
            ("compressed_vocab_size", PF_INT64, np.array([layout.compressed_vocab_size], np.int64)),
            ("primes", PF_INT64, np.ascontiguousarray(layout.primes.reshape(-1), np.int64)),
            ("offsets", PF_INT64, np.ascontiguousarray(layout.offsets.reshape(-1), np.int64)),
            ("multipliers", PF_INT64, np.ascontiguousarray(layout.multipliers.reshape(-1), np.int64))]


def hash_fields_text(layout):
    """The ONNX form: int64 arrays as comma-separated decimal text (kCHAR)."""
    text = {name: np.frombuffer(",".join(str(int(v)) for v in arr.reshape(-1)).encode(), dtype=np.uint8)
            for name, arr in (("primes", layout.primes), ("offsets", layout.offsets),
                              ("multipliers", layout.multipliers))}
    return [f if f[0] not in text else (f[0], PF_CHAR, text[f[0]]) for f in hash_fields(layout)]


def gather_fields(layer, L, cols, head_dim, dtype_code, block, rows):
    return [("layer_index", PF_INT32, np.array([layer], np.int32)), ("n_layers", PF_INT32, np.array([L], np.int32)),
            ("n_cols", PF_INT32, np.array([cols], np.int32)), ("head_dim", PF_INT32, np.array([head_dim], np.int32)),
            ("table_dtype", PF_INT32, np.array([dtype_code], np.int32)),
            ("quant_block", PF_INT32, np.array([block], np.int32)), ("num_rows", PF_INT64, np.array([rows], np.int64))]


def column_range_fields(column_begin, column_end, row_offset):
    """EngramGather's optional fields of a tensor-parallel rank: its columns and the global
    row id of its table slice's first row."""
    return [("column_begin", PF_INT32, np.array([column_begin], np.int32)),
            ("column_end", PF_INT32, np.array([column_end], np.int32)),
            ("row_offset", PF_INT64, np.array([row_offset], np.int64))]


def gate_fields(hc, D, eps):
    return [("hc_mult", PF_INT32, np.array([hc], np.int32)), ("hidden_size", PF_INT32, np.array([D], np.int32)),
            ("eps", PF_FLOAT32, np.array([eps], np.float32))]


def add_check_arguments(ap) -> None:
    """The options :func:`start` and a script's :func:`run_checks` read: the build's
    (--build-dir, --trt-include, --archs, --skip-build), --seed and --out."""
    ap.add_argument("--build-dir", type=Path, default=REPO / "build-h200")
    ap.add_argument("--trt-include", type=Path, default=None, help="TensorRT headers (default: CMake's lookup)")
    ap.add_argument("--archs", default="90")
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh randomness each run")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "build-h200" / "out")))


def start(args) -> int:
    """The check scripts' common start: the run's seed (``--seed`` or fresh, recorded and
    printed), the build unless ``--skip-build``, and ENGRAM_TRT_PLUGIN_LIB pointing at the
    build's library. Returns the seed."""
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    RESULTS["seed"] = seed
    say(f"seed {seed}")
    if not args.skip_build:
        build(args.build_dir, args.trt_include, args.archs)
    os.environ["ENGRAM_TRT_PLUGIN_LIB"] = str(args.build_dir / "libengram_trt_plugins.so")
    return seed


def build(build_dir: Path, trt_include: Path | None, archs: str) -> Path:
    """Configure and build the library and the plugin harness for ``archs`` (the GPU
    check scripts' one build step)."""
    cmd = ["cmake", "-S", str(REPO), "-B", str(build_dir), f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
           "-DENGRAM_TRT_BUILD_HARNESS=ON", "-DCMAKE_BUILD_TYPE=Release"]
    if trt_include is not None:
        cmd.append(f"-DTENSORRT_INCLUDE_DIR={trt_include}")
    t0 = time.time()
    for c in (cmd, ["cmake", "--build", str(build_dir), f"-j{os.cpu_count() or 2}"]):
        say("$ " + " ".join(c))
        proc = subprocess.run(c, capture_output=True, text=True)
        if proc.returncode != 0:
            say(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"build failed: {' '.join(c)}")
    say(f"built in {time.time() - t0:.1f} s")
    return build_dir

