#!/usr/bin/env python3
"""Pinned and shared table stores on a GPU: real CUDA host registration, in chunks.

One device call, no plugin library needed (it is used for one extra check when built):
  1. Small FP8 and BF16 checkpoints, and the demo checkpoint (2.4 GiB of FP8 tables:
     three 1 GiB registration chunks), are written on the device.
  2. Pinned store through ``open_tables(refs, 'pinned')``: every chunk is registered
     (cudaPointerGetAttributes: host memory, device pointer == host pointer), the GPU
     reads the tables through UVA (each layer's bytes wrapped as a CUDA tensor at the
     host address, rows gathered on the GPU) and gets exactly the bytes of the
     checkpoint, and close() leaves every chunk unregistered. Small tables are also
     registered in 2 MiB chunks (many chunks, for real).
  3. Shared store, two processes: A creates the /dev/shm segment and registers it; B
     starts meanwhile, waits, attaches and registers its own mapping; both gather rows
     on the GPU through UVA and must match the CPU reference; both map one file; a third
     process re-attaches after both exit (the restart case), without writing.
  4. The device store's bytes equal the pinned store's UVA reads (same tables).
Writes $OUT/h200_tables_check.json; prints a table of checks and timings last; exits 1
if any check fails.

  python3 scripts/h200_tables_check.py --out "$OUT"   [--no-demo: small tables only]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import engram_trt  # noqa: E402,F401  (before torch: sets torch's OpenMP wait policy, see engram_trt/__init__.py)

import torch  # noqa: E402

from engram_trt.checkpoint.checkpoint import Checkpoint  # noqa: E402
from engram_trt.tables import segment as seg  # noqa: E402
from engram_trt.tables.hostmem import CudaRegistrar  # noqa: E402
from engram_trt.tables.source import checkpoint_table_refs  # noqa: E402
from engram_trt.tables.store import open_tables  # noqa: E402

GiB = 1 << 30


class TimingRegistrar:
    """The real registrar, timed."""

    def __init__(self) -> None:
        self.inner = CudaRegistrar()
        self.name = self.inner.name
        self.register_s = self.unregister_s = 0.0
        self.calls = 0

    def register(self, address: int, nbytes: int) -> None:
        t = time.perf_counter()
        self.inner.register(address, nbytes)
        self.register_s += time.perf_counter() - t
        self.calls += 1

    def unregister(self, address: int) -> None:
        t = time.perf_counter()
        self.inner.unregister(address)
        self.unregister_s += time.perf_counter() - t

    def device_pointer(self, address: int) -> int:
        return self.inner.device_pointer(address)


def pointer_attributes(address: int) -> tuple[str, int]:
    """(memory type, device pointer) of an address, from the CUDA runtime."""
    from cuda.bindings import runtime as rt

    err, attr = rt.cudaPointerGetAttributes(address)
    if err != rt.cudaError_t.cudaSuccess:
        return f"error {int(err)}", 0
    kinds = {int(rt.cudaMemoryType.cudaMemoryTypeUnregistered): "unregistered", int(rt.cudaMemoryType.cudaMemoryTypeHost): "host",
             int(rt.cudaMemoryType.cudaMemoryTypeDevice): "device", int(rt.cudaMemoryType.cudaMemoryTypeManaged): "managed"}
    return kinds.get(int(attr.type), str(attr.type)), int(attr.devicePointer or 0)


class _HostBytes:
    """A host tensor's bytes offered to torch as CUDA memory (valid once registered: UVA)."""

    def __init__(self, t: torch.Tensor) -> None:
        b = t.view(torch.uint8)
        self.__cuda_array_interface__ = {"shape": tuple(b.shape), "typestr": "|u1", "data": (b.data_ptr(), False),
                                         "version": 3, "strides": None}


def uva_gather_digest(store: Any, seed: int = 0, n: int = 4096) -> tuple[str, str]:
    """sha256 of rows (and scales) gathered on the GPU straight from the store's host
    memory, and of the same rows gathered on the CPU."""
    g = torch.Generator().manual_seed(seed)
    gpu, cpu = hashlib.sha256(), hashlib.sha256()
    for i in range(store.num_layers):
        ids = torch.randint(0, store.num_rows(i), (n,), generator=g)
        for t in store.tensors(i):
            if t is None:
                continue
            dev = torch.as_tensor(_HostBytes(t), device="cuda")
            assert dev.is_cuda and dev.data_ptr() == t.data_ptr()
            gpu.update(dev.index_select(0, ids.cuda()).cpu().numpy().tobytes())
            cpu.update(t.view(torch.uint8).index_select(0, ids).numpy().tobytes())
    torch.cuda.synchronize()
    return gpu.hexdigest(), cpu.hexdigest()


def chunk_states(chunks: list[tuple[int, int]]) -> list[tuple[str, bool]]:
    """Per chunk: memory type at its start and middle, and whether device == host pointer."""
    out = []
    for at, length in chunks:
        for probe in (at, at + length // 2):
            kind, dev = pointer_attributes(probe)
            out.append((kind, dev == probe))
    return out


def check_pinned(refs: list, label: str, chunk_bytes: int, checks: list, timings: dict) -> str:
    reg = TimingRegistrar()
    t0 = time.perf_counter()
    store = open_tables(refs, "pinned", registrar=reg, chunk_bytes=chunk_bytes, progress=False)
    load_s = time.perf_counter() - t0
    want_chunks = math.ceil(store.buffer_bytes / chunk_bytes)
    checks.append((f"pinned {label}: {len(store.chunks)} chunks of {chunk_bytes >> 20} MiB registered",
                   len(store.chunks) == want_chunks == reg.calls, f"expected {want_chunks}; through {reg.name}"))
    states = chunk_states(store.chunks)
    checks.append((f"pinned {label}: every chunk is host memory at device ptr == host ptr (UVA)",
                   all(k == "host" and same for k, same in states), f"{states[:4]}..."))
    gpu, cpu = uva_gather_digest(store)
    checks.append((f"pinned {label}: GPU gather through UVA == CPU gather", gpu == cpu, gpu[:16]))
    try:
        from engram_trt.native import kernels

        kernels.library_path()
        kind = kernels.pointer_kind(store.tensors(0)[0])
        checks.append((f"pinned {label}: kernel library sees the table as 'host'", kind == "host", kind))
    except Exception as exc:  # noqa: BLE001 - optional: the library may not be built on this machine
        checks.append((f"pinned {label}: kernel-library pointer check (skipped: library not built)", True, str(exc)[:80]))
    chunks = list(store.chunks)
    store.close()
    after = chunk_states(chunks)
    checks.append((f"pinned {label}: close() unregistered every chunk", all(k != "host" for k, _ in after), f"{after[:2]}"))
    gb = store.buffer_bytes / 1e9
    timings[f"pinned {label}"] = {"bytes": store.buffer_bytes, "load_s": round(load_s, 3),
                                  "register_s": round(reg.register_s, 3), "unregister_s": round(reg.unregister_s, 3),
                                  "load_GBps": round(gb / load_s, 2) if load_s else None,
                                  "register_GBps": round(gb / reg.register_s, 2) if reg.register_s else None,
                                  "pages": store.pages}
    return gpu


def child_main(ckpt: str, shm: str, hold: bool) -> int:
    """One process of the shared check: open, verify registration, gather on the GPU."""
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    refs = checkpoint_table_refs(Checkpoint.open(ckpt))
    t0 = time.perf_counter()
    store = open_tables(refs, "shared", directory=shm, progress=False)
    open_s = time.perf_counter() - t0
    states = chunk_states(store.chunks)
    gpu, cpu = uva_gather_digest(store)
    print(json.dumps({"pid": os.getpid(), "kind": store.kind, "created": store.created,
                      "creator_pid": store.header.creator_pid, "path": str(store.path), "chunks": len(store.chunks),
                      "registered_uva": all(k == "host" and same for k, same in states), "gpu": gpu, "cpu": cpu,
                      "open_s": round(open_s, 3), "bytes": store.header.total_size, "gpu_readable": store.gpu_readable}),
          flush=True)
    if hold:
        sys.stdin.readline()
    chunks = list(store.chunks)
    store.close()
    print(json.dumps({"unregistered": all(k != "host" for k, _ in chunk_states(chunks))}), flush=True)
    return 0


def check_shared(ckpt: Path, refs: list, label: str, expected_gpu: str, checks: list, timings: dict) -> None:
    shm = Path(tempfile.mkdtemp(prefix="engram-trt-h200-", dir="/dev/shm"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(ckpt), str(shm)]
    try:
        a = subprocess.Popen(cmd + ["--hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # B starts while A is (for the demo tables) still writing
        b = subprocess.Popen(cmd + ["--hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ra, rb = json.loads(a.stdout.readline()), json.loads(b.stdout.readline())
        path = Path(ra["path"])
        mappers = sorted(seg.mapped_by([path])[path])
        for p in (a, b):
            p.stdin.close()
        ua, ub = json.loads(a.stdout.readline()), json.loads(b.stdout.readline())
        a.wait(60), b.wait(60)
        err_b = b.stderr.read()
        created = sorted([ra["created"], rb["created"]])
        first = ra if ra["created"] else rb
        checks.append((f"shared {label}: one process created the segment, the other attached",
                       created == [False, True] and ra["creator_pid"] == rb["creator_pid"] == first["pid"],
                       f"A created={ra['created']} B created={rb['created']} creator={ra['creator_pid']}"))
        checks.append((f"shared {label}: both registered their mapping (UVA, device ptr == host ptr)",
                       ra["registered_uva"] and rb["registered_uva"] and ra["gpu_readable"] and rb["gpu_readable"],
                       f"chunks A={ra['chunks']} B={rb['chunks']}"))
        checks.append((f"shared {label}: both GPU gathers == CPU gather == pinned",
                       ra["gpu"] == rb["gpu"] == ra["cpu"] == expected_gpu, ra["gpu"][:16]))
        checks.append((f"shared {label}: both processes map the one segment", mappers == sorted([a.pid, b.pid]), f"{mappers}"))
        checks.append((f"shared {label}: close() unregistered in both", ua["unregistered"] and ub["unregistered"], ""))
        import hashlib

        mtime = path.stat().st_mtime_ns
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        c = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        rc = json.loads(c.stdout.splitlines()[0])
        # "Without writing": the segment's bytes are unchanged and this process did not
        # create it. (Pinning a writable shared mapping for UVA may bump the file's mtime
        # without changing a byte, so the mtime is reported, not checked.)
        same = hashlib.sha256(path.read_bytes()).hexdigest() == before
        checks.append((f"shared {label}: a restarted process re-attaches without writing",
                       not rc["created"] and rc["gpu"] == expected_gpu and same,
                       f"attach {rc['open_s']} s, created={rc['created']}, gpu rows equal={rc['gpu'] == expected_gpu}, "
                       f"bytes unchanged={same}, mtime changed={path.stat().st_mtime_ns != mtime}"))
        timings[f"shared {label}"] = {"bytes": ra["bytes"], "create_s": first["open_s"],
                                      "attach_while_creating_s": (rb if ra["created"] else ra)["open_s"],
                                      "reattach_s": rc["open_s"], "waited": "waiting for" in err_b}
    finally:
        seg.clean(shm, all_=True, force=True)
        shutil.rmtree(shm, ignore_errors=True)


def small_checkpoint(path: Path, table_dtype: str) -> list:
    """A small checkpoint with random tables (two Engram layers), written in small
    shards; returns its table refs (the GPU machine has no pytest: not the tests' helper)."""
    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout

    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 97, "hc_mult": 2, "tie_word_embeddings": False,
           "engram_layer_ids": [0, 2], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 64,
           "engram_vocab_size": 40000, "engram_compressed_vocab_size": 60, "engram_pad_token_id": 1,
           "engram_table_dtype": table_dtype}
    mc = ModelConfig.from_dict(cfg)
    rows = [int(r) for r in EngramLayout.from_spec(mc.engram, pad_id=1).table_rows]
    write_checkpoint(path, cfg, random_weights(mc, torch.Generator().manual_seed(0), table_rows=rows), None,
                     max_shard_bytes=4 << 20)
    return checkpoint_table_refs(Checkpoint.open(path))


def check_tables(out: Path, demo: bool = True) -> tuple[bool, dict]:
    """The whole check (callable from a merged GPU script): (all passed, results)."""
    checks: list[tuple[str, bool, str]] = []
    timings: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="engram-trt-tables-"))
    try:
        cases = []
        for dtype in ("fp8", "bf16"):
            refs = small_checkpoint(work / dtype, dtype)
            cases.append((f"small {dtype}", work / dtype, refs, 2 << 20))
        if demo:
            from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint

            t0 = time.perf_counter()
            d = ensure_demo_checkpoint()
            timings["demo checkpoint"] = {"s": round(time.perf_counter() - t0, 1)}
            cases.append(("demo 2.4 GiB", d, checkpoint_table_refs(Checkpoint.open(d)), GiB))
        for label, path, refs, chunk in cases:
            gpu = check_pinned(refs, label, chunk, checks, timings)
            dev = open_tables(refs, "device", progress=False)
            g = torch.Generator().manual_seed(0)
            h = hashlib.sha256()
            for i in range(dev.num_layers):
                ids = torch.randint(0, dev.num_rows(i), (4096,), generator=g).cuda()
                for t in dev.tensors(i):
                    if t is not None:
                        h.update(t.view(torch.uint8).index_select(0, ids).cpu().numpy().tobytes())
            checks.append((f"device {label}: same bytes as the pinned UVA gather", h.hexdigest() == gpu, h.hexdigest()[:16]))
            dev.close()
            del dev
            torch.cuda.empty_cache()
            check_shared(path, refs, label, gpu, checks, timings)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(c[1] for c in checks)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "ok": ok,
           "checks": [{"check": c, "ok": o, "detail": d} for c, o, d in checks], "timings": timings}
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_tables_check.json").write_text(json.dumps(res, indent=1))
    return ok, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="folder for the JSON result")
    ap.add_argument("--no-demo", action="store_true", help="small tables only (skips the 2.4 GiB demo tables)")
    ap.add_argument("--child", nargs=2, metavar=("CKPT", "SHM_DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args.child[0], args.child[1], args.hold)
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the GPU registration of the pinned and shared stores", file=sys.stderr)
        return 2
    ok, res = check_tables(Path(args.out), demo=not args.no_demo)
    print(f"\n{res['device']}, torch {res['torch']}")
    w = max(len(c["check"]) for c in res["checks"])
    for c in res["checks"]:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']:<{w}}  {c['detail']}")
    print("\ntimings:")
    for k, v in res["timings"].items():
        print(f"  {k}: {json.dumps(v)}")
    print(f"\n{sum(c['ok'] for c in res['checks'])} of {len(res['checks'])} checks pass")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
