"""Pinned and shared table stores on a GPU: real CUDA host registration, in chunks
(formerly scripts/h200_tables_check.py; no plugin library needed, it is used for one
extra check).

  1. Small FP8 and BF16 checkpoints and the demo checkpoint (2.4 GiB of FP8 tables, three
     1 GiB registration chunks) are written.
  2. Pinned store through ``open_tables(refs, 'pinned')``: every chunk is registered
     (cudaPointerGetAttributes: host memory, device pointer == host pointer), the GPU
     reads the tables through UVA (each layer's bytes wrapped as a CUDA tensor at the
     host address, rows gathered on the GPU) and gets exactly the bytes of the
     checkpoint, and close() leaves every chunk unregistered. Small tables are also
     registered in 2 MiB chunks (many chunks, for real).
  3. Shared store, two processes (tests/gpu/tables_child.py): A creates the /dev/shm
     segment and registers it; B starts meanwhile, waits, attaches and registers its own
     mapping; both gather rows on the GPU through UVA and must match the CPU reference;
     both map one file; a third process re-attaches after both exit (the restart case),
     without writing.
  4. The device store's bytes equal the pinned store's UVA reads (same tables).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .helpers import REPO, TESTS, Checks, note

GiB = 1 << 30
LABELS = ["small fp8", "small bf16", "demo 2.4 GiB"]
CHUNK_MIB = {"small fp8": 2, "small bf16": 2, "demo 2.4 GiB": 1024}


class TimingRegistrar:
    """The real registrar, timed."""

    def __init__(self) -> None:
        from engram_trt.tables.hostmem import CudaRegistrar

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


def check_pinned(refs: list, label: str, chunk_bytes: int, checks: Checks, timings: dict) -> str:
    from engram_trt.tables.store import open_tables

    from .tables_child import chunk_states, uva_gather_digest

    reg = TimingRegistrar()
    t0 = time.perf_counter()
    store = open_tables(refs, "pinned", registrar=reg, chunk_bytes=chunk_bytes, progress=False)
    load_s = time.perf_counter() - t0
    want_chunks = math.ceil(store.buffer_bytes / chunk_bytes)
    checks.add(
        f"pinned {label}: chunks of {chunk_bytes >> 20} MiB registered",
        len(store.chunks) == want_chunks == reg.calls,
        f"{len(store.chunks)} chunks, {reg.calls} registered, expected {want_chunks}; through {reg.name}",
    )
    states = chunk_states(store.chunks)
    checks.add(
        f"pinned {label}: every chunk is host memory at device ptr == host ptr (UVA)",
        all(k == "host" and same for k, same in states),
        f"{states[:4]}...",
    )
    gpu, cpu = uva_gather_digest(store)
    checks.add(f"pinned {label}: GPU gather through UVA == CPU gather", gpu == cpu, gpu[:16])
    try:
        from engram_trt.native import library as kernel_library

        kernel_library.library_path()
        kind = kernel_library.pointer_kind(store.tensors(0)[0])
        checks.add(f"pinned {label}: kernel library sees the table as 'host'", kind == "host", kind)
    except Exception as exc:  # noqa: BLE001 - optional: the library may not be built on this machine
        checks.add(
            f"pinned {label}: kernel library sees the table as 'host'",
            True,
            f"kernel-library pointer check skipped: library not built: {str(exc)[:80]}",
        )
    chunks = list(store.chunks)
    store.close()
    after = chunk_states(chunks)
    checks.add(f"pinned {label}: close() unregistered every chunk", all(k != "host" for k, _ in after), f"{after[:2]}")
    gb = store.buffer_bytes / 1e9
    timings[f"pinned {label}"] = {
        "bytes": store.buffer_bytes,
        "load_s": round(load_s, 3),
        "register_s": round(reg.register_s, 3),
        "unregister_s": round(reg.unregister_s, 3),
        "load_GBps": round(gb / load_s, 2) if load_s else None,
        "register_GBps": round(gb / reg.register_s, 2) if reg.register_s else None,
        "pages": store.pages,
    }
    return gpu


def check_shared(ckpt: Path, refs: list, label: str, expected_gpu: str, checks: Checks, timings: dict) -> None:
    from engram_trt.tables import segment as seg

    shm = Path(tempfile.mkdtemp(prefix="engram-trt-h200-", dir="/dev/shm"))
    cmd = [sys.executable, "-m", "gpu.tables_child", str(ckpt), str(shm)]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(TESTS), str(REPO / "python")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    )
    try:
        a = subprocess.Popen(
            cmd + ["--hold"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(REPO),
        )
        time.sleep(0.5)  # B starts while A is (for the demo tables) still writing
        b = subprocess.Popen(
            cmd + ["--hold"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(REPO),
        )
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
        checks.add(
            f"shared {label}: one process created the segment, the other attached",
            created == [False, True] and ra["creator_pid"] == rb["creator_pid"] == first["pid"],
            f"A created={ra['created']} B created={rb['created']} creator={ra['creator_pid']}",
        )
        checks.add(
            f"shared {label}: both registered their mapping (UVA, device ptr == host ptr)",
            ra["registered_uva"] and rb["registered_uva"] and ra["gpu_readable"] and rb["gpu_readable"],
            f"chunks A={ra['chunks']} B={rb['chunks']}",
        )
        checks.add(
            f"shared {label}: both GPU gathers == CPU gather == pinned",
            ra["gpu"] == rb["gpu"] == ra["cpu"] == expected_gpu,
            ra["gpu"][:16],
        )
        checks.add(
            f"shared {label}: both processes map the one segment", mappers == sorted([a.pid, b.pid]), f"{mappers}"
        )
        checks.add(f"shared {label}: close() unregistered in both", ua["unregistered"] and ub["unregistered"], "")
        mtime = path.stat().st_mtime_ns
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        c = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
        rc = json.loads(c.stdout.splitlines()[0])
        # "Without writing": the segment's bytes are unchanged and this process did not
        # create it. (Pinning a writable shared mapping for UVA may bump the file's mtime
        # without changing a byte, so the mtime is reported, not checked.)
        same = hashlib.sha256(path.read_bytes()).hexdigest() == before
        checks.add(
            f"shared {label}: a restarted process re-attaches without writing",
            not rc["created"] and rc["gpu"] == expected_gpu and same,
            f"attach {rc['open_s']} s, created={rc['created']}, gpu rows equal={rc['gpu'] == expected_gpu}, "
            f"bytes unchanged={same}, mtime changed={path.stat().st_mtime_ns != mtime}",
        )
        timings[f"shared {label}"] = {
            "bytes": ra["bytes"],
            "create_s": first["open_s"],
            "attach_while_creating_s": (rb if ra["created"] else ra)["open_s"],
            "reattach_s": rc["open_s"],
            "waited": "waiting for" in err_b,
        }
    finally:
        seg.clean(shm, all_=True, force=True)
        shutil.rmtree(shm, ignore_errors=True)


def small_checkpoint(path: Path, table_dtype: str) -> list:
    """A small checkpoint with random tables (two Engram layers), written in small
    shards; returns its table refs."""
    import torch

    from engram_trt.checkpoint.checkpoint import Checkpoint, write_checkpoint
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.tables.source import checkpoint_table_refs

    cfg = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 97,
        "hc_mult": 2,
        "tie_word_embeddings": False,
        "engram_layer_ids": [0, 2],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_vocab_size": 40000,
        "engram_compressed_vocab_size": 60,
        "engram_pad_token_id": 1,
        "engram_table_dtype": table_dtype,
    }
    mc = ModelConfig.from_dict(cfg)
    rows = [int(r) for r in EngramLayout.from_spec(mc.engram, pad_id=1).table_rows]
    write_checkpoint(
        path, cfg, random_weights(mc, torch.Generator().manual_seed(0), table_rows=rows), None, max_shard_bytes=4 << 20
    )
    return checkpoint_table_refs(Checkpoint.open(path))


# Each label's checks, in the order the stages run; "{label}" stands for the label.
TABLE_CHECKS = [
    "pinned {label}: chunks of {chunk} MiB registered",
    "pinned {label}: every chunk is host memory at device ptr == host ptr (UVA)",
    "pinned {label}: GPU gather through UVA == CPU gather",
    "pinned {label}: kernel library sees the table as 'host'",
    "pinned {label}: close() unregistered every chunk",
    "device {label}: same bytes as the pinned UVA gather",
    "shared {label}: one process created the segment, the other attached",
    "shared {label}: both registered their mapping (UVA, device ptr == host ptr)",
    "shared {label}: both GPU gathers == CPU gather == pinned",
    "shared {label}: both processes map the one segment",
    "shared {label}: close() unregistered in both",
    "shared {label}: a restarted process re-attaches without writing",
]


def check_tables(label: str, tmp: Path) -> SimpleNamespace:
    """One label's stages in turn (pinned -> device -> shared: dependent steps, each
    later one compares against the pinned store's UVA gather): ``checks`` (a Checks by
    the names of TABLE_CHECKS), ``timings``, and ``error`` (the traceback of a stage that
    raised, which leaves the later checks unrecorded) or None."""
    import torch

    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.tables.source import checkpoint_table_refs
    from engram_trt.tables.store import open_tables

    checks = Checks()
    timings: dict[str, Any] = {}
    error = None
    try:
        if label.startswith("small"):
            dtype = label.split()[1]
            path, chunk = tmp / dtype, 2 << 20
            refs = small_checkpoint(path, dtype)
        else:
            from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint

            t0 = time.perf_counter()
            path, chunk = ensure_demo_checkpoint(), GiB
            timings["demo checkpoint"] = {"s": round(time.perf_counter() - t0, 1)}
            refs = checkpoint_table_refs(Checkpoint.open(path))
        gpu = check_pinned(refs, label, chunk, checks, timings)
        dev = open_tables(refs, "device", progress=False)
        g = torch.Generator().manual_seed(0)
        h = hashlib.sha256()
        for i in range(dev.num_layers):
            ids = torch.randint(0, dev.num_rows(i), (4096,), generator=g).cuda()
            for t in dev.tensors(i):
                if t is not None:
                    h.update(t.view(torch.uint8).index_select(0, ids).cpu().numpy().tobytes())
        checks.add(f"device {label}: same bytes as the pinned UVA gather", h.hexdigest() == gpu, h.hexdigest()[:16])
        dev.close()
        del dev
        torch.cuda.empty_cache()
        check_shared(path, refs, label, gpu, checks, timings)
    except Exception:  # noqa: BLE001 - reported by every check it left unrecorded
        error = traceback.format_exc()
    return SimpleNamespace(checks=checks, timings=timings, error=error)


@pytest.fixture(scope="module", params=LABELS)
def tables_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One label's run of check_tables, shared by its checks' tests."""
    label = request.param
    run = check_tables(label, tmp_path_factory.mktemp("tables"))
    run.label = label
    return run


@pytest.mark.parametrize(
    "check", TABLE_CHECKS, ids=[c.replace(" {label}", "").replace(" of {chunk} MiB", "") for c in TABLE_CHECKS]
)
def test_tables(tables_run: SimpleNamespace, check: str) -> None:
    label = tables_run.label
    note(f"timings {label}", tables_run.timings)
    name = check.format(label=label, chunk=CHUNK_MIB[label])
    assert name in tables_run.checks, f"{name}: not reached: {tables_run.error}"
    ok, detail = tables_run.checks[name]
    assert ok, f"{name}: {detail}"
