"""Table stores: file, shared (/dev/shm) and pinned give exactly the in-memory tables.

The reference is the tensors the test itself wrote into the checkpoint (``TableStore.
from_tensors`` over them) and, for the rows, an independent float64 NumPy dequantization
(``quant.dequant_fp8_rows``). The shared store is exercised by real processes (``python
-c``) attaching to one segment, a creator SIGKILLed mid-write through the creator's
test hook (``ENGRAM_TRT_TEST_SHM_PAUSE``, see engram_trt/tables/shared.py), and the
``engram-trt shm`` commands. The pinned store's GPU registration is replaced by a fake
registrar that records every call (the real one runs in tests/gpu/test_tables.py).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names, write_checkpoint
from engram_trt.models.engram_llama.demo import random_weights
from engram_trt.config.model import ModelConfig
from engram_trt.engram.layout import EngramLayout
from engram_trt.engram.quant import dequant_fp8_rows
from engram_trt.errors import EngramError
from engram_trt.tables import segment as seg
from engram_trt.tables.hostmem import (
    PAGE,
    HostRegistration,
    allocate_anonymous,
    chunk_ranges,
    hugetlb_free_bytes,
    plan_layout,
)
from engram_trt.tables.pinned import PinnedTables
from engram_trt.tables.shared import TEST_PAUSE_ENV, SharedTables, expected_header
from engram_trt.tables.source import checkpoint_table_refs
from engram_trt.tables.base import MemoryTables, TableStore
from engram_trt.tables.store import open_tables

from helpers.checkpoints import SMALL_TABLES_CONFIG
from helpers.tables import FakeRegistrar
from helpers.files import REPO

PYTHON_DIR = REPO / "python"
CONFIG = SMALL_TABLES_CONFIG  # the checkpoint tests' small model (two Engram layers, FP8 tables)


# ------------------------------------------------------------------ fixtures
class Checkpointed:
    """A small checkpoint on disk and the table tensors written into it."""

    def __init__(self, path: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> None:
        self.path = path
        self.config = ModelConfig.from_dict(cfg)
        spec = self.config.engram
        assert spec is not None
        self.fp8 = spec.table_dtype == "fp8"
        names = [engram_tensor_names(lid) for lid in spec.layer_ids]
        self.tables = [weights[n["table"]] for n in names]
        self.scales = [weights[n["scale"]] if self.fp8 else None for n in names]
        self.refs = checkpoint_table_refs(Checkpoint.open(path))

    def reference(self) -> TableStore:
        return TableStore.from_tensors(self.tables, self.scales)

    def rows_f64(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of ``layer`` in float64, straight from the written tensors."""
        t = self.tables[layer]
        if not self.fp8:
            return t.float().numpy().astype(np.float64)[ids]
        s = self.scales[layer]
        assert s is not None
        return dequant_fp8_rows(t.view(torch.uint8).numpy()[ids], s.view(torch.uint8).numpy()[ids], 32).astype(
            np.float64
        )

    def digest(self) -> str:
        """sha256 over every table's bytes in layout order (what the child processes report)."""
        h = hashlib.sha256()
        for t, s in zip(self.tables, self.scales):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
            if s is not None:
                h.update(s.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def make_checkpoint(path: Path, table_dtype: str, seed: int = 0) -> Checkpointed:
    cfg = dict(CONFIG, engram_table_dtype=table_dtype)
    mc = ModelConfig.from_dict(cfg)
    assert mc.engram is not None
    rows = [int(r) + 7 for r in EngramLayout.from_spec(mc.engram, pad_id=1).table_rows]
    weights = random_weights(mc, torch.Generator().manual_seed(seed), table_rows=rows)
    # Small shards: the tables of one checkpoint lie in several files at several offsets.
    write_checkpoint(path, cfg, weights, None, max_shard_bytes=8 * 1024)
    return Checkpointed(path, cfg, weights)


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def ck(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpointed:
    return make_checkpoint(tmp_path_factory.mktemp(f"ck-{request.param}") / "ck", request.param)


@pytest.fixture(scope="module")
def ck8(tmp_path_factory: pytest.TempPathFactory) -> Checkpointed:
    return make_checkpoint(tmp_path_factory.mktemp("ck8") / "ck", "fp8", seed=3)


@pytest.fixture()
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A private segment directory: under /dev/shm when writable (tmpfs, as in
    production), else under the test's tmp dir. Always removed afterwards."""
    base = Path("/dev/shm")
    d = (
        Path(tempfile.mkdtemp(prefix="engram-trt-test-", dir=base))
        if base.is_dir() and os.access(base, os.W_OK)
        else tmp_path / "shm"
    )
    d.mkdir(exist_ok=True)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def assert_same_tables(store: TableStore, ck: Checkpointed) -> None:
    """tensors() byte-equal to the written tensors; rows() equal to the in-memory
    store and to the float64 NumPy dequantization, for every row and a random batch."""
    ref = ck.reference()
    assert store.num_layers == ref.num_layers == 2
    gen = torch.Generator().manual_seed(7)
    for i in range(ref.num_layers):
        t, s = store.tensors(i)
        rt, rs = ref.tensors(i)
        assert t.dtype == rt.dtype and t.shape == rt.shape
        assert torch.equal(t.view(torch.uint8), rt.view(torch.uint8))
        assert (s is None) == (rs is None) == (not ck.fp8)
        if s is not None:
            assert torch.equal(s, rs)
        n = ref.num_rows(i)
        for ids in (torch.arange(n), torch.randint(0, n, (5, 9), generator=gen)):
            got = store.rows(i, ids)
            assert torch.equal(got, ref.rows(i, ids))
            want = ck.rows_f64(i, ids.reshape(-1).numpy()).reshape(*ids.shape, -1)
            np.testing.assert_array_equal(got.double().numpy(), want)


# ------------------------------------------------------------------ file, memory, shared: same rows
def test_file_memory_and_shared_stores_match_in_memory_tables(ck: Checkpointed, shm_dir: Path) -> None:
    for kind in ("memory", "file", "shared"):
        store = open_tables(ck.refs, kind, directory=shm_dir) if kind == "shared" else open_tables(ck.refs, kind)
        assert store.kind == kind
        assert_same_tables(store, ck)
        store.close()
    files = sorted(p.name for p in shm_dir.iterdir())
    name = seg.segment_name(seg.layout_hash(ck.refs))
    assert files == [name, seg.lock_name(name)]


def test_shared_segment_header_layout_and_permissions(ck: Checkpointed, shm_dir: Path) -> None:
    store = SharedTables.open(ck.refs, directory=shm_dir, progress=False)
    assert isinstance(store, SharedTables) and store.created and not store.gpu_readable
    path = store.path
    for p in (path, shm_dir / seg.lock_name(path.name)):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    raw = path.read_bytes()
    assert raw[:8] == b"ENGRMTBL"
    assert int.from_bytes(raw[8:12], "little") == seg.FORMAT_VERSION
    assert int.from_bytes(raw[12:16], "little") == 0x59444552  # ready
    assert int.from_bytes(raw[16:24], "little") == len(raw) == path.stat().st_size
    assert int.from_bytes(raw[24:32], "little") == os.getpid()
    hdr = seg.read_header(path)
    assert hdr is not None and hdr.layout_hash == seg.layout_hash(ck.refs)
    assert path.name == f"engram-trt-{hdr.layout_hash[:16]}.tables"
    # Every table at a 2 MiB boundary after the header, its bytes those written to disk.
    for entry, ref in zip(hdr.tables, [r for r in ck.refs]):
        assert entry["offset"] % (2 << 20) == 0 and entry["offset"] >= seg.HEADER.size
        with open(ref.file, "rb") as f:
            f.seek(ref.offset)
            assert raw[entry["offset"] : entry["offset"] + entry["nbytes"]] == f.read(ref.nbytes)
    assert {e["tensor"] for e in hdr.tables} == {r.tensor for r in ck.refs}
    store.close()
    # The segment outlives its store: a new open attaches and writes nothing.
    mtime = path.stat().st_mtime_ns
    again = SharedTables.open(ck.refs, directory=shm_dir, progress=False)
    assert isinstance(again, SharedTables) and not again.created and again.header.creator_pid == os.getpid()
    assert path.stat().st_mtime_ns == mtime
    assert_same_tables(again, ck)
    again.close()


# ------------------------------------------------------------------ real processes
CHILD = r"""
import hashlib, json, logging, os, sys
sys.path.insert(0, {python_dir!r})
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
import torch
from engram_trt.checkpoint.checkpoint import Checkpoint
from engram_trt.tables.source import checkpoint_table_refs
from engram_trt.tables.shared import SharedTables
refs = checkpoint_table_refs(Checkpoint.open({ck!r}))
st = SharedTables.open(refs, 32, progress=False, directory={shm!r})
h, r = hashlib.sha256(), hashlib.sha256()
for i in range(st.num_layers):
    t, s = st.tensors(i)
    h.update(t.view(torch.uint8).numpy().tobytes())
    if s is not None:
        h.update(s.numpy().tobytes())
    r.update(st.rows(i, torch.arange(st.num_rows(i))).view(torch.int16).numpy().tobytes())
path = str(st.path)
maps = open("/proc/self/maps").read()
print(json.dumps({{"pid": os.getpid(), "created": st.created, "creator_pid": st.header.creator_pid, "path": path,
                  "ino": os.stat(path).st_ino, "mapped": path in maps, "tables": h.hexdigest(), "rows": r.hexdigest(),
                  "kind": st.kind}}), flush=True)
if {hold!r}:
    sys.stdin.readline()
st.close()
"""


class Child:
    """A ``python -c`` child attaching to the shared tables; its stdout and stderr lines
    are collected by threads, so every wait below has a timeout instead of a hang."""

    def __init__(self, ck: Checkpointed, shm: Path, hold: bool = False, pause: str | None = None) -> None:
        env = dict(os.environ)
        env.pop(TEST_PAUSE_ENV, None)
        if pause is not None:
            env[TEST_PAUSE_ENV] = pause
        code = CHILD.format(python_dir=str(PYTHON_DIR), ck=str(ck.path), shm=str(shm), hold=hold)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.proc.pid
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.err_lines: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out, None), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err, self.err_lines), daemon=True),
        ]
        for t in self._threads:
            t.start()
        LIVE_CHILDREN.append(self)

    @staticmethod
    def _pump(stream: Any, q: queue.Queue, keep: list[str] | None) -> None:
        for line in stream:
            if keep is not None:
                keep.append(line)
            q.put(line)
        q.put("")

    def _next(self, q: queue.Queue, timeout: float) -> str:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"child {self.pid} printed nothing for {timeout} s; its stderr: {''.join(self.err_lines)}"
            ) from None

    def result(self, timeout: float = 90.0) -> dict[str, Any]:
        line = self._next(self.out, timeout)
        assert line, f"child {self.pid} ended without a result; its stderr: {''.join(self.err_lines)}"
        return json.loads(line)

    def wait_for(self, needle: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(self.err, max(0.1, deadline - time.monotonic()))
            if not line:
                raise AssertionError(f"{needle!r} never appeared; child {self.pid}'s stderr: {''.join(self.err_lines)}")
            if needle in line:
                return line

    def finish(self, timeout: float = 90.0) -> int:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        rc = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return rc

    def stderr_text(self) -> str:
        return "".join(self.err_lines)


LIVE_CHILDREN: list[Child] = []


@pytest.fixture(autouse=True)
def _no_child_left() -> Iterator[None]:
    """A failed test must not leave a child holding a lock or a mapping."""
    yield
    while LIVE_CHILDREN:
        c = LIVE_CHILDREN.pop()
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait(timeout=30)


def rows_digest(ck: Checkpointed) -> str:
    ref = ck.reference()
    r = hashlib.sha256()
    for i in range(ref.num_layers):
        r.update(ref.rows(i, torch.arange(ref.num_rows(i))).view(torch.int16).numpy().tobytes())
    return r.hexdigest()


def test_two_processes_share_one_segment(ck8: Checkpointed, shm_dir: Path) -> None:
    """A starts creating and pauses mid-write (test hook) holding the lock; B starts
    meanwhile and waits for the lock; A resumes (SIGUSR1) and finishes; B attaches to
    what A made: one segment, written once."""
    a = Child(ck8, shm_dir, hold=True, pause="1:120")
    a.wait_for("test hook: paused")
    b = Child(ck8, shm_dir, hold=True)
    waited = b.wait_for("waiting for")
    os.kill(a.pid, signal.SIGUSR1)
    try:
        out_a = a.result()
        out_b = b.result()
        name = seg.segment_name(seg.layout_hash(ck8.refs))
        path = shm_dir / name
        assert out_a["created"] is True and out_b["created"] is False
        assert out_a["creator_pid"] == out_b["creator_pid"] == a.pid
        assert out_a["path"] == out_b["path"] == str(path) and out_a["ino"] == out_b["ino"] == path.stat().st_ino
        assert out_a["mapped"] and out_b["mapped"]
        assert out_a["tables"] == out_b["tables"] == ck8.digest()
        assert out_a["rows"] == out_b["rows"] == rows_digest(ck8)
        # One copy: one segment file of the planned size (no temp file left), and both
        # processes map that one file now.
        _, _, total = expected_header(ck8.refs, seg.layout_hash(ck8.refs))
        assert sorted(p.name for p in shm_dir.iterdir()) == [name, seg.lock_name(name)]
        assert path.stat().st_size == total
        assert sorted(seg.mapped_by([path])[path]) == sorted([a.pid, b.pid])
        hdr = seg.read_header(path)
        assert hdr is not None and hdr.ready and hdr.creator_pid == a.pid
        mtime = path.stat().st_mtime_ns
    finally:
        rcs = [p.finish() for p in (a, b)]
    err_b = b.stderr_text()
    assert f"waiting for pid {a.pid} to finish creating the shared tables {path}" in waited
    assert f"attached to shared tables {path}" in err_b and "creating shared tables" not in err_b
    assert rcs == [0, 0]
    # A third process, after both are gone, re-attaches without writing.
    c = Child(ck8, shm_dir)
    out_c = c.result()
    assert c.finish() == 0
    assert out_c["created"] is False and out_c["creator_pid"] == a.pid and out_c["rows"] == rows_digest(ck8)
    assert path.stat().st_mtime_ns == mtime


def test_creator_killed_mid_write_is_rebuilt(
    ck8: Checkpointed, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = Child(ck8, shm_dir, pause="1")  # stops after the first table, until killed
    line = a.wait_for("test hook: paused")
    name = seg.segment_name(seg.layout_hash(ck8.refs))
    tmp = shm_dir / seg.temp_name(name, a.pid)
    assert str(tmp) in line and tmp.exists() and not (shm_dir / name).exists()
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o600
    a.proc.send_signal(signal.SIGKILL)
    assert a.finish() == -signal.SIGKILL
    # What a killed creator leaves: a temp file, header not ready, its lock free.
    listed = {f.name: f for f in seg.scan(shm_dir)}
    assert listed[tmp.name].state == "half-written" and listed[tmp.name].creator_alive is False
    hdr = seg.read_header(tmp)
    assert hdr is not None and not hdr.ready and hdr.creator_pid == a.pid
    with caplog.at_level(logging.WARNING, logger="engram_trt.tables.shared"):
        store = SharedTables.open(ck8.refs, directory=shm_dir, progress=False)
    assert isinstance(store, SharedTables) and store.created and store.header.creator_pid == os.getpid()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tmp) in m and "half-written" in m and f"pid {a.pid}" in m and "gone" in m for m in warned), warned
    assert not tmp.exists()
    assert_same_tables(store, ck8)
    store.close()


def test_final_segment_without_ready_flag_is_rebuilt(
    ck8: Checkpointed, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SharedTables.open(ck8.refs, directory=shm_dir, progress=False)
    path = store.path
    store.close()
    with open(path, "r+b") as f:  # as if the flag never made it; the data damaged too
        f.seek(seg.READY_OFFSET)
        f.write(b"\0\0\0\0")
        f.seek(seg.read_header(path).tables[0]["offset"])  # type: ignore[union-attr]
        f.write(b"\xff" * 64)
    assert [f.state for f in seg.scan(shm_dir) if f.name == path.name] == ["half-written"]
    with caplog.at_level(logging.WARNING, logger="engram_trt.tables.shared"):
        again = SharedTables.open(ck8.refs, directory=shm_dir, progress=False)
    assert isinstance(again, SharedTables) and again.created
    assert any(str(path) in r.getMessage() and "ready flag" in r.getMessage() for r in caplog.records)
    assert_same_tables(again, ck8)
    again.close()


@pytest.mark.parametrize("damage", ["version", "layout", "size", "magic"])
def test_incompatible_segment_is_refused(ck8: Checkpointed, shm_dir: Path, damage: str) -> None:
    store = SharedTables.open(ck8.refs, directory=shm_dir, progress=False)
    path = store.path
    store.close()
    raw = bytearray(path.read_bytes())
    if damage == "version":
        raw[8:12] = (seg.FORMAT_VERSION + 1).to_bytes(4, "little")
        want = f"format version {seg.FORMAT_VERSION + 1}"
    elif damage == "layout":
        raw[48:112] = b"0" * 64
        want = "hold other tables"
    elif damage == "size":
        raw = raw[:-4096]
        want = "damaged"
    else:
        raw[:8] = b"NOTOURS!"
        want = "not ours"
    path.write_bytes(bytes(raw))
    before = path.read_bytes()
    with pytest.raises(EngramError) as err:
        SharedTables.open(ck8.refs, directory=shm_dir, progress=False)
    msg = str(err.value)
    assert want in msg and str(path) in msg and "\n" not in msg
    if damage != "magic":
        assert f"engram-trt shm clean {path.name}" in msg
    assert path.read_bytes() == before  # refused, not rewritten


def test_too_little_shm_falls_back_to_private_memory(
    ck: Checkpointed, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[Path] = []

    def tiny(d: Path) -> int:
        asked.append(d)
        return 4096

    with caplog.at_level(logging.WARNING, logger="engram_trt.tables.shared"):
        store = SharedTables.open(ck.refs, directory=shm_dir, free_space=tiny, progress=False)
    assert asked == [shm_dir]
    assert isinstance(store, MemoryTables) and store.kind == "memory"
    msg = " ".join(r.getMessage() for r in caplog.records)
    _, _, total = expected_header(ck.refs, seg.layout_hash(ck.refs))
    assert total == (1 + len(ck.refs)) * (2 << 20)  # the header's 2 MiB, then one 2 MiB-aligned slot per table
    assert (
        f"{shm_dir} has 4.0 KiB free but the tables need {total / 2**20:.1f} MiB" in msg
        and "private host memory" in msg
    )
    assert_same_tables(store, ck)
    assert not any(p.suffix in (".tables", ".tmp") for p in shm_dir.iterdir())
    # With a GPU the fallback is private pinned memory, registered like the pinned store.
    fake = FakeRegistrar()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engram_trt.tables.shared"):
        pinned = SharedTables.open(
            ck.refs, directory=shm_dir, free_space=tiny, register=True, registrar=fake, progress=False
        )
    assert isinstance(pinned, PinnedTables) and fake.live and "private pinned memory" in caplog.text
    assert_same_tables(pinned, ck)
    pinned.close()
    assert not fake.live


def test_shared_store_registers_its_mapping_in_chunks(ck8: Checkpointed, shm_dir: Path) -> None:
    fake = FakeRegistrar()
    store = SharedTables.open(
        ck8.refs, directory=shm_dir, register=True, registrar=fake, chunk_bytes=2 << 20, progress=False
    )
    assert isinstance(store, SharedTables) and store.gpu_readable
    total = store.header.total_size
    starts = sorted(fake.registered)
    assert sum(n for _, n in starts) == total and len(starts) == total // (2 << 20)
    assert all(b[0] == a[0] + a[1] for a, b in zip(starts, starts[1:]))
    t, _ = store.tensors(0)
    assert starts[0][0] <= t.data_ptr() < starts[-1][0] + starts[-1][1]
    store.close()
    assert not fake.live and len(fake.unregistered) == len(starts)


# ------------------------------------------------------------------ engram-trt shm
def shm_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engram_trt", "shm", *args], cwd=PYTHON_DIR, capture_output=True, text=True, timeout=120
    )


def test_shm_list_and_clean(ck8: Checkpointed, shm_dir: Path) -> None:
    holder = Child(ck8, shm_dir, hold=True)
    out = holder.result()
    name = Path(out["path"]).name
    foreign = shm_dir / "engram-trt-0123456789abcdef.tables"
    foreign.write_bytes(b"someone else's file" * 10)
    try:
        r = shm_cli("list", "--json", "--dir", str(shm_dir))
        assert r.returncode == 0, r.stderr
        listed = {s["name"]: s for s in json.loads(r.stdout)["segments"]}
        s = listed[name]
        assert s["state"] == "ready" and s["creator_pid"] == holder.pid and s["creator_alive"] is True
        assert s["mapped_by"] == [holder.pid] and s["layout_hash"] == seg.layout_hash(ck8.refs)
        assert s["size"] == Path(out["path"]).stat().st_size
        assert listed[foreign.name]["state"] == "not ours"
        text = shm_cli("list", "--dir", str(shm_dir)).stdout
        assert name in text and f"{holder.pid} (alive)" in text
        # In use by a live process: refused, naming it; nothing removed.
        r = shm_cli("clean", name, "--dir", str(shm_dir))
        assert r.returncode == 2 and r.stderr.count("\n") == 1
        assert f"{name} is mapped by pid {holder.pid}" in r.stderr and "--force" in r.stderr
        r = shm_cli("clean", "--all", "--dir", str(shm_dir))
        assert r.returncode == 2 and str(holder.pid) in r.stderr
        assert (shm_dir / name).exists()
        # Not ours: never touched, even by name or --force.
        r = shm_cli("clean", foreign.name, "--force", "--dir", str(shm_dir))
        assert r.returncode == 2 and "not ours" in r.stderr and foreign.exists()
    finally:
        assert holder.finish() == 0
    r = shm_cli("list", "--json", "--dir", str(shm_dir))
    s = {s["name"]: s for s in json.loads(r.stdout)["segments"]}[name]
    assert s["mapped_by"] == [] and s["creator_alive"] is False
    r = shm_cli("clean", name, "--dir", str(shm_dir))
    assert r.returncode == 0, r.stderr
    assert f"removed {shm_dir / name}" in r.stdout
    assert sorted(p.name for p in shm_dir.iterdir()) == [foreign.name]  # segment and its lock gone
    assert shm_cli("clean", "--all", "--dir", str(shm_dir)).returncode == 0 and foreign.exists()


def test_shm_clean_default_removes_only_leftovers_and_force(ck8: Checkpointed, shm_dir: Path) -> None:
    a = Child(ck8, shm_dir, pause="1")
    a.wait_for("test hook: paused")
    name = seg.segment_name(seg.layout_hash(ck8.refs))
    tmp = shm_dir / seg.temp_name(name, a.pid)
    # Being written (its creator holds the lock): the default clean leaves it.
    assert shm_cli("clean", "--dir", str(shm_dir)).returncode == 0 and tmp.exists()
    a.proc.send_signal(signal.SIGKILL)
    assert a.finish() == -signal.SIGKILL
    listed = shm_cli("list", "--dir", str(shm_dir)).stdout
    assert tmp.name in listed and "half-written" in listed and f"{a.pid} (gone)" in listed
    ready = SharedTables.open(ck8.refs, directory=shm_dir, progress=False)  # rebuilds (removes tmp itself) ...
    assert not tmp.exists()
    tmp.write_bytes(b"")  # ... so leave a blank temp file as a creator killed before its header would
    r = shm_cli("clean", "--dir", str(shm_dir))
    assert r.returncode == 0 and f"removed {tmp}" in r.stdout and not tmp.exists()
    assert ready.path.exists()  # the default clean never removes a ready segment
    # --force removes a segment this (live) process maps; the mapping keeps working.
    r = shm_cli("clean", ready.path.name, "--dir", str(shm_dir))
    assert r.returncode == 2 and f"pid {os.getpid()}" in r.stderr
    r = shm_cli("clean", ready.path.name, "--force", "--dir", str(shm_dir))
    assert r.returncode == 0 and not ready.path.exists()
    assert_same_tables(ready, ck8)
    ready.close()


def test_shm_cli_bad_input(shm_dir: Path) -> None:
    for args, needle in [
        (["clean", "x.tables", "--dir", str(shm_dir)], "not an engram-trt segment name"),
        (["clean", "engram-trt-0123456789abcdef.tables", "--dir", str(shm_dir)], "no segment"),
        (["clean", "engram-trt-0123456789abcdef.tables", "--all", "--dir", str(shm_dir)], "not both"),
        (["list", "--dir", str(shm_dir / "missing")], "does not exist"),
        (["frobnicate"], "invalid choice"),
        ([], "needs an action"),
    ]:
        r = shm_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    r = shm_cli("list", "--dir", str(shm_dir))
    assert r.returncode == 0 and r.stdout.strip() == f"no engram-trt segments in {shm_dir}"
    help_text = shm_cli("clean", "--help").stdout
    for flag in ("--all", "--force", "--dir", "NAME"):
        assert flag in help_text


# ------------------------------------------------------------------ pinned
def test_chunk_ranges_cover_exactly_once() -> None:
    for total, chunk in [(10 * PAGE, 3 * PAGE), (4 * PAGE, 4 * PAGE), (PAGE, 8 * PAGE), ((5 << 30) + PAGE, 1 << 30)]:
        pieces = chunk_ranges(total, chunk)
        covered = np.zeros(total // PAGE, dtype=np.int64)
        for off, n in pieces:
            assert 0 < n <= chunk and off % PAGE == 0
            covered[off // PAGE : (off + n) // PAGE] += 1
        assert (covered == 1).all() and sum(n for _, n in pieces) == total
        assert all(n == chunk for _, n in pieces[:-1])
    assert len(chunk_ranges((5 << 30) + PAGE, 1 << 30)) == 6
    for bad in (0, -PAGE, PAGE + 1):
        with pytest.raises(EngramError, match="multiple of the page size"):
            chunk_ranges(10 * PAGE, bad)


def test_plan_layout_aligns_every_table(ck: Checkpointed) -> None:
    placed, total = plan_layout(ck.refs, start=100)
    assert [p.ref.role for p in placed] == (["rows", "scales"] * 2 if ck.fp8 else ["rows"] * 2)
    ends = [p.offset + p.ref.nbytes for p in placed]
    assert all(p.offset % (2 << 20) == 0 for p in placed) and placed[0].offset >= 100
    assert all(e <= nxt.offset for e, nxt in zip(ends, placed[1:])) and ends[-1] <= total and total % (2 << 20) == 0


def test_pinned_load_path_with_fake_registrar(ck: Checkpointed) -> None:
    fake = FakeRegistrar()
    read: list[tuple[str, int]] = []

    def reader(ref: Any, out: torch.Tensor, bar: Any) -> None:
        from engram_trt.tables.base import read_region_into

        assert out.dtype == torch.uint8 and out.numel() == ref.nbytes
        read.append((ref.tensor, ref.nbytes))
        read_region_into(ref, out, bar)

    chunk = 256 * 1024 + PAGE  # not a divisor of the buffer: the last chunk is partial
    store = PinnedTables.load(ck.refs, progress=False, registrar=fake, reader=reader, chunk_bytes=chunk)
    assert store.kind == "pinned" and store.gpu_readable
    assert sorted(read) == sorted((r.tensor, r.nbytes) for r in ck.refs)
    chunks = sorted(fake.registered)
    assert chunks[0][0] == store.address and store.address % (2 << 20) == 0
    assert all(b[0] == a[0] + a[1] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1][0] + chunks[-1][1] == store.address + store.buffer_bytes
    assert all(n == chunk for _, n in chunks[:-1]) and 0 < chunks[-1][1] < chunk
    assert len(chunks) == -(-store.buffer_bytes // chunk)
    for i in range(store.num_layers):  # the tensors lie inside the registered range
        for t in store.tensors(i):
            if t is not None:
                assert (
                    store.address <= t.data_ptr()
                    and t.data_ptr() + t.numel() * t.element_size() <= store.address + store.buffer_bytes
                )
    assert_same_tables(store, ck)
    assert store.describe()["registered_chunks"] == len(chunks) and "fake registrar" in store.where()
    store.close()
    assert sorted(fake.unregistered) == sorted(a for a, _ in chunks) and not fake.live
    store.close()  # idempotent: nothing unregistered twice
    assert len(fake.unregistered) == len(chunks)
    with pytest.raises(EngramError, match="closed"):
        store.tensors(0)


def test_pinned_released_on_garbage_collection(ck8: Checkpointed) -> None:
    fake = FakeRegistrar()
    store = PinnedTables.load(ck8.refs, progress=False, registrar=fake, chunk_bytes=1 << 20)
    assert fake.live
    del store
    gc.collect()
    assert not fake.live and fake.registered


@pytest.mark.parametrize("failure", ["register", "uva"])
def test_pinned_registration_failure_rolls_back(ck8: Checkpointed, failure: str) -> None:
    fake = FakeRegistrar(fail_at=3) if failure == "register" else FakeRegistrar(shift=4096)
    with pytest.raises(EngramError) as err:
        PinnedTables.load(ck8.refs, progress=False, registrar=fake, chunk_bytes=1 << 20)
    msg = str(err.value)
    if failure == "register":
        assert "chunk 4 of" in msg and "out of memory" in msg and len(fake.registered) == 3
    else:
        assert "no unified virtual addressing" in msg and "cpu_offload=false" in msg
    assert not fake.live and fake.registered  # every chunk registered so far was undone


def test_host_registration_direct() -> None:
    fake = FakeRegistrar()
    reg = HostRegistration.register(fake, 1 << 40, 10 * PAGE, 4 * PAGE)
    assert reg.chunks == [(1 << 40, 4 * PAGE), ((1 << 40) + 4 * PAGE, 4 * PAGE), ((1 << 40) + 8 * PAGE, 2 * PAGE)]
    reg.release()
    assert fake.unregistered == [(1 << 40) + 8 * PAGE, (1 << 40) + 4 * PAGE, 1 << 40] and not reg.chunks


def test_allocate_anonymous_huge_page_modes() -> None:
    buf = allocate_anonymous(3 << 20, "auto")
    assert len(buf.mm) >= buf.base + buf.nbytes and buf.nbytes == 3 << 20
    if "transparent" in buf.pages:
        assert buf.address % (2 << 20) == 0
    buf.mm[buf.base : buf.base + 4] = b"abcd"
    assert bytes(buf.mm[buf.base : buf.base + 4]) == b"abcd"
    buf.mm.close()
    free, _ = hugetlb_free_bytes()
    if free >= 4 << 20:
        b = allocate_anonymous(3 << 20, "hugetlbfs")
        assert "hugetlbfs" in b.pages
        b.mm.close()
    else:
        with pytest.raises(EngramError, match="nr_hugepages"):
            allocate_anonymous(3 << 20, "hugetlbfs")
    plain = allocate_anonymous(PAGE, "none")
    assert plain.base == 0 and "KiB pages" in plain.pages
    plain.mm.close()
    with pytest.raises(EngramError, match="huge_pages"):
        allocate_anonymous(PAGE, "sometimes")


def test_open_tables_pinned_needs_cuda_here(ck8: Checkpointed) -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA (the GPU path: tests/gpu/test_tables.py)")
    with pytest.raises(EngramError, match="needs a CUDA device"):
        open_tables(ck8.refs, "pinned")


def test_layout_hash_follows_the_files(ck8: Checkpointed, tmp_path: Path) -> None:
    """Checkpoint refs carry no sha256: the hash is keyed by the files, so a copy of the
    checkpoint (new inodes) gets its own segment, and a recorded sha256 is used instead."""
    import dataclasses

    copy = tmp_path / "copy"
    shutil.copytree(ck8.path, copy)
    refs2 = checkpoint_table_refs(Checkpoint.open(copy))
    assert seg.layout_hash(ck8.refs) == seg.layout_hash(checkpoint_table_refs(Checkpoint.open(ck8.path)))
    assert seg.layout_hash(refs2) != seg.layout_hash(ck8.refs)
    with_sha = [dataclasses.replace(r, sha256=hashlib.sha256(r.tensor.encode()).hexdigest()) for r in ck8.refs]
    moved = [dataclasses.replace(r, file=r2.file, offset=r2.offset) for r, r2 in zip(with_sha, refs2)]
    assert seg.layout_hash(with_sha) == seg.layout_hash(moved)  # content-keyed: wherever the files lie
    assert seg.layout_hash(with_sha) != seg.layout_hash(ck8.refs)


def test_giga_pages_refused_with_the_reservation_to_make(monkeypatch) -> None:
    """No (or too few) reserved 1 GiB pages: one line naming how many are needed and
    where to reserve them, before any mapping is tried."""
    from engram_trt.tables import hostmem

    monkeypatch.setattr(hostmem, "giga_pages_free", lambda: 2)
    with pytest.raises(
        EngramError, match=r"1 GiB huge pages: 3 needed, 2 free; reserve them \(echo 3 > .*nr_hugepages"
    ):
        hostmem.allocate_anonymous(2 * hostmem.GIGA_PAGE + 1, huge_pages="hugetlbfs-1g")


def test_auto_falls_back_when_the_giga_pages_are_gone(monkeypatch) -> None:
    """'auto' counted enough free 1 GiB pages but the mapping failed (another process
    took them): it goes on to the other huge pages instead of failing the load."""
    from engram_trt.tables import hostmem

    monkeypatch.setattr(hostmem, "giga_pages_free", lambda: 4)

    def taken(nbytes: int):
        raise EngramError("1 GiB huge pages: 1 needed, 0 free")

    monkeypatch.setattr(hostmem, "map_giga_pages", taken)
    b = hostmem.allocate_anonymous(hostmem.GIGA_PAGE // 2, huge_pages="auto")
    assert "1 GiB" not in b.pages
    with pytest.raises(EngramError, match="1 GiB huge pages: 1 needed, 0 free"):
        hostmem.allocate_anonymous(hostmem.GIGA_PAGE // 2, huge_pages="hugetlbfs-1g")
