"""StagedRows' lazy protocol, which the runtime's prefetch relies on: a layer's rows are
waited for at their first read only, once, in the reader's stream; ``wait()`` waits for
every layer; ``finish()`` runs the lookup's host-side completion (the gather driver's
failure check). The streams are stand-ins here (no GPU); the GPU side is checked by
tests/gpu/test_driver.py and tests/gpu/test_runtime.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engram_trt.runtime import prefetch  # noqa: E402
from engram_trt.runtime.staged_rows import StagedRows  # noqa: E402


@pytest.fixture
def fake_stream(monkeypatch: pytest.MonkeyPatch) -> object:
    stream = object()
    monkeypatch.setattr(prefetch.torch.cuda, "current_stream", lambda device=None: stream)
    return stream


def _views(n: int) -> list:
    return [torch.full((2, 3, 4), float(i)) for i in range(n)]


def test_a_waiter_runs_once_per_layer_at_its_first_read(fake_stream: object) -> None:
    calls: list = []
    views = _views(3)
    rows = StagedRows(views, waiter=lambda i, s: calls.append((i, s)))
    assert calls == []  # nothing waits before a read
    assert rows[1] is views[1]
    assert calls == [(1, fake_stream)]
    assert rows[1] is views[1] and calls == [(1, fake_stream)]  # once
    assert rows[0] is views[0] and rows[2] is views[2]
    assert [c[0] for c in calls] == [1, 0, 2]
    rows.wait()  # every layer waited for already: no further wait
    assert len(calls) == 3


def test_wait_covers_every_layer_and_finish_runs_the_hook(fake_stream: object) -> None:
    calls: list = []
    finished: list = []
    rows = StagedRows(_views(2), waiter=lambda i, s: calls.append(i), finish=lambda: finished.append(True))
    rows.wait()
    assert calls == [0, 1]
    assert list(rows) == rows._views
    rows.finish()
    assert finished == [True]


def test_a_failed_lookup_surfaces_at_finish(fake_stream: object) -> None:
    def fail() -> None:
        raise prefetch.EngramError("host gather job 3 failed: table_dtype 7 is neither fp8_e4m3 (0) nor bf16 (1)")

    rows = StagedRows(_views(1), waiter=lambda i, s: None, finish=fail)
    rows[0]
    with pytest.raises(prefetch.EngramError, match="host gather job 3 failed: table_dtype 7"):
        rows.finish()


def test_ready_rows_need_no_wait_and_finish_is_a_no_op() -> None:
    views = _views(2)
    rows = StagedRows(views)  # rows computed synchronously (the CPU reference path)
    assert rows[0] is views[0] and rows[1] is views[1]
    rows.wait()
    rows.finish()
    assert rows.shapes == [(2, 3, 4), (2, 3, 4)]


def _prefetcher_over(store: object) -> prefetch.Prefetcher:
    """A Prefetcher's table bookkeeping alone (its __init__ needs a GPU for the rest)."""
    pf = prefetch.Prefetcher.__new__(prefetch.Prefetcher)
    pf.tables, pf.device, pf._hbm_scales = store, torch.device("cpu"), None
    return pf


def test_scales_move_to_gpu_memory_only_within_their_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host gather reads fp8 scales from GPU memory when their copy takes at most
    HBM_SCALES_MAX_FRACTION of the free memory; then its table layout is 'hbm-scales' and
    a row brings only its values from the host."""
    import numpy as np

    from engram_trt.tables.base import TableStore

    rng = np.random.default_rng(3)
    rows = [torch.from_numpy(rng.integers(0, 256, (1000, 64), dtype=np.uint8)) for _ in range(2)]
    scales = [torch.from_numpy(rng.integers(100, 150, (1000, 2), dtype=np.uint8)) for _ in range(2)]
    pf = _prefetcher_over(TableStore.from_tensors(rows, scales))
    need = 2 * 1000 * 2  # both layers' scale bytes
    budget_free = int(need / prefetch.HBM_SCALES_MAX_FRACTION)
    assert pf.row_bytes == 66 and pf.host_layout == "split"

    monkeypatch.setattr(prefetch.torch.cuda, "mem_get_info", lambda device=None: (budget_free - 10, 1 << 40))
    assert pf._scales_to_hbm() is None  # a byte over the budget: the scales stay on the host

    monkeypatch.setattr(prefetch.torch.cuda, "mem_get_info", lambda device=None: (budget_free, 1 << 40))
    copied = pf._scales_to_hbm()
    assert copied is not None and len(copied) == 2
    assert all(torch.equal(c, s) for c, s in zip(copied, scales))
    pf._hbm_scales = copied
    assert pf.host_layout == "hbm-scales"
    assert pf.row_bytes == 64  # the values alone cross the link
    got_rows, got_scales, qb, layout = pf._host_table(1)
    assert got_rows.data_ptr() == rows[1].data_ptr() and torch.equal(got_rows, rows[1])  # the store's rows, in place
    assert got_scales is copied[1] and qb == 32 and layout == "hbm-scales"


def test_bf16_tables_keep_the_split_layout() -> None:
    from engram_trt.tables.base import TableStore

    tables = [torch.zeros((100, 32), dtype=torch.bfloat16) for _ in range(2)]
    pf = _prefetcher_over(TableStore.from_tensors(tables, [None, None]))
    assert pf._scales_to_hbm() is None  # no scales to move (and no GPU asked)
    assert pf.host_layout == "split" and pf.row_bytes == 64


def test_wait_layer_waits_as_a_read_does(fake_stream: object) -> None:
    """What a replayed graph segment calls before it reads a layer's staging directly."""
    calls: list = []
    rows = StagedRows(_views(2), waiter=lambda i, s: calls.append((i, s)))
    rows.wait_layer(1)
    assert calls == [(1, fake_stream)]
    rows.wait_layer(1)
    rows.wait_layer(0)
    assert calls == [(1, fake_stream), (0, fake_stream)]
