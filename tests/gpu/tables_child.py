"""The shared-store child process of test_tables.py (formerly ``scripts/h200_tables_check.py
--child``): open the store, verify its registration, gather on the GPU through UVA, print
one JSON line; with ``--hold`` wait for a line on stdin before closing; then print whether
close() unregistered every chunk. And the UVA helpers test_tables.py shares.

    python -m gpu.tables_child CKPT SHM_DIR [--hold]    (tests/ on PYTHONPATH)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import engram_trt  # noqa: F401 - before torch: sets torch's OpenMP wait policy (engram_trt/__init__.py)

import torch

from engram_trt.checkpoint.checkpoint import Checkpoint
from engram_trt.tables.source import checkpoint_table_refs
from engram_trt.tables.store import open_tables


def pointer_attributes(address: int) -> tuple[str, int]:
    """(memory type, device pointer) of an address, from the CUDA runtime."""
    from cuda.bindings import runtime as rt

    err, attr = rt.cudaPointerGetAttributes(address)
    if err != rt.cudaError_t.cudaSuccess:
        return f"error {int(err)}", 0
    kinds = {
        int(rt.cudaMemoryType.cudaMemoryTypeUnregistered): "unregistered",
        int(rt.cudaMemoryType.cudaMemoryTypeHost): "host",
        int(rt.cudaMemoryType.cudaMemoryTypeDevice): "device",
        int(rt.cudaMemoryType.cudaMemoryTypeManaged): "managed",
    }
    return kinds.get(int(attr.type), str(attr.type)), int(attr.devicePointer or 0)


class _HostBytes:
    """A host tensor's bytes offered to torch as CUDA memory (valid once registered: UVA)."""

    def __init__(self, t: torch.Tensor) -> None:
        b = t.view(torch.uint8)
        self.__cuda_array_interface__ = {
            "shape": tuple(b.shape),
            "typestr": "|u1",
            "data": (b.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


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
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "kind": store.kind,
                "created": store.created,
                "creator_pid": store.header.creator_pid,
                "path": str(store.path),
                "chunks": len(store.chunks),
                "registered_uva": all(k == "host" and same for k, same in states),
                "gpu": gpu,
                "cpu": cpu,
                "open_s": round(open_s, 3),
                "bytes": store.header.total_size,
                "gpu_readable": store.gpu_readable,
            }
        ),
        flush=True,
    )
    if hold:
        sys.stdin.readline()
    chunks = list(store.chunks)
    store.close()
    print(json.dumps({"unregistered": all(k != "host" for k, _ in chunk_states(chunks))}), flush=True)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(child_main(args[0], args[1], "--hold" in args[2:]))
