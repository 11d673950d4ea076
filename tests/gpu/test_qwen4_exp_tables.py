"""Qwen4Exp's PLE tables in every table store on a GPU (issue 30 item 3).

1. bf16 shards (12 per table, in two safetensors files, name order in each file) opened
   in each store (memory, file, shared in a temporary directory, pinned, device): the
   rows gathered onto the GPU equal the concatenated shards, through the path each
   store allows (host gather for memory / file, the UVA or HBM gather kernel for
   shared / pinned / device); f32 rows go through the reference path.
2. The tiny checkpoint (tests/data/qwen4_exp_tiny) through ``engram_trt.LLM`` on CUDA
   with each ``--engram-config`` placement (default: pinned; cpu_offload false: device;
   host_file_gather: file): the recorded greedy tokens, the store the config asks for.
"""

from __future__ import annotations

import json
from pathlib import Path
import struct

import pytest

from .helpers import REPO

DATA = REPO / "tests" / "data" / "qwen4_exp_tiny"
WANT_PATH = {"memory": "host", "file": "host", "shared": "kernel", "pinned": "kernel", "device": "kernel"}


def _bf16_refs(folder, dtype_name="BF16"):
    import torch
    from safetensors.torch import save_file

    from engram_trt.tables.source import TableRef

    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if dtype_name == "BF16" else torch.float32
    shards = [(torch.randn(50 + 7 * (i % 5), 64, generator=gen)).to(dtype) for i in range(12)]
    files = [folder / f"part{k}.safetensors" for k in range(2)]
    for k, f in enumerate(files):
        save_file({f"x.shard_{i}.weight": t for i, t in enumerate(shards) if i % 2 == k}, str(f))
    refs = []
    for k, f in enumerate(files):
        raw = f.read_bytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + hlen])
        for i, t in enumerate(shards):
            if i % 2 == k:
                lo, hi = header[f"x.shard_{i}.weight"]["data_offsets"]
                refs.append(
                    TableRef(
                        0,
                        0,
                        "rows",
                        f"x.shard_{i}.weight",
                        f,
                        8 + hlen + lo,
                        hi - lo,
                        tuple(t.shape),
                        dtype_name,
                        part=i,
                    )
                )
    return refs, torch.cat(shards)


@pytest.mark.parametrize("kind", sorted(WANT_PATH))
def test_stores_gather_bf16_ple_rows_on_cuda(kind, tmp_path) -> None:
    import torch

    from engram_trt.tables.rowgather import StoreGather
    from engram_trt.tables.store import open_tables

    import shutil
    import tempfile

    refs, whole = _bf16_refs(tmp_path)
    # A shared segment lives in /dev/shm (tmpfs): CUDA cannot register file-backed pages
    # of an ordinary filesystem. A private folder there, removed after.
    shm = Path(tempfile.mkdtemp(prefix="engram-trt-ple-", dir="/dev/shm")) if kind == "shared" else None
    opts = {"directory": shm} if shm is not None else {}
    store = open_tables(refs, kind, device="cuda", progress=False, **opts)
    g = StoreGather(store, "cuda")
    assert g.paths == [WANT_PATH[kind]], f"{kind}: gather path: {g.paths}"
    ids = torch.randint(0, whole.shape[0], (257, 6))
    got = g.gather(0, ids)
    assert got.is_cuda and torch.equal(got.cpu(), whole[ids]), (
        f"{kind}: rows equal the concatenated shards: shape {tuple(got.shape)} on {got.device}"
    )
    g.close()
    store.close()
    if shm is not None:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("kind", ["file", "pinned", "device"])
def test_f32_rows_take_the_reference_path(tmp_path, kind) -> None:
    import torch

    from engram_trt.tables.rowgather import StoreGather
    from engram_trt.tables.store import open_tables

    refs, whole = _bf16_refs(tmp_path, "F32")
    store = open_tables(refs, kind, device="cuda", progress=False)
    try:
        g = StoreGather(store, "cuda")
        ids = torch.randint(0, whole.shape[0], (33, 4))
        got = g.gather(0, ids)
        assert g.paths == ["reference"] and torch.equal(got.cpu(), whole[ids]), (
            f"{kind} f32: reference path, rows equal: {g.paths}"
        )
    finally:
        store.close()


@pytest.mark.parametrize(
    "ecfg, kind", [(None, "pinned"), ({"cpu_offload": False}, "device"), ({"host_file_gather": True}, "file")]
)
def test_llm_on_cuda_in_each_store(ecfg, kind) -> None:
    from engram_trt import LLM, SamplingParams

    want = json.loads((DATA / "expected.json").read_text())
    with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32", engram_config=ecfg) as llm:
        storage = llm.storage
        outs = llm.generate(
            want["prompts"], SamplingParams(max_tokens=want["new_tokens"], temperature=0.0, ignore_eos=True)
        )
    assert storage["kind"] == kind, f"{kind}: the store the config asks for: {storage}"
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want["greedy"], f"{kind}: recorded greedy tokens: {got} vs {want['greedy']}"
