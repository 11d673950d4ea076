"""The hot-row cache serving float rows (bf16 / f16 / f32, Qwen4Exp's PLE tables), on a CPU.

* A float table's cached rows are bit for bit the plain gather's (f32 rows whose low
  halves are bf16 NaN / inf patterns included: the cache carries bytes, it must never
  convert), over skewed steps with misses, hits, replacements and out-of-range ids
  (zero rows), and its decisions (slot map, counts, replacements) are the FP8 cache's on
  the same ids: the policy never depends on the rows' dtype.
* The FP8 tests' behaviours on float rows: a step's misses fill free slots and the same
  ids are hits next step; a full cache replaces only strictly colder rows; a warm start
  serves its rows exactly.
* :class:`CachedStoreGather` over a memory store and a store whose table is several
  regions in place equals :class:`StoreGather`, steps larger than the cache's step
  split included; a bad id is refused before the step (checked) or counted by the
  sentinel row (check_bad_rows).
* ``--engram-config.hot_cache_fraction``: parsed, bad values and contradictions refused
  in one line; an Engram (non-PLE) model refuses it.
* The committed tiny Qwen4Exp (tests/data/qwen4_exp_tiny, f32 PLE rows; its recorded
  tokens are transformers' greedy tokens, tests/models/qwen4_exp/test_qwen4_exp_parity.py) with the cache
  on gives the recorded tokens, through the model and through LLM, with hits counted.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engram_trt.cache.hotcache import HotRowCache
from engram_trt.cache.storecache import CachedStoreGather
from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError
from engram_trt.tables.base import TableStore
from engram_trt.tables.rowgather import StoreGather

from helpers.files import DATA

N, WIDTH = 3000, 24
TINY = DATA / "qwen4_exp_tiny"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _table(dtype: torch.dtype, seed: int = 3) -> torch.Tensor:
    """Random rows; f32 rows get low halves that are bf16 NaN / inf bit patterns, f16 /
    bf16 rows some NaN / inf values, so any conversion on the way would show."""
    gen = torch.Generator().manual_seed(seed)
    t = (torch.randn(N, WIDTH, generator=gen) * 3).to(dtype)
    bits = t.view(torch.int32 if dtype == torch.float32 else torch.int16)
    if dtype == torch.float32:
        bits[::7, ::3] = (bits[::7, ::3] & ~0xFFFF) | 0x7FC1  # low half: a bf16 NaN with a payload
        bits[1::7, 1::3] = (bits[1::7, 1::3] & ~0xFFFF) | 0x7F80  # low half: bf16 +inf
    else:
        t[::11, 0] = float("nan")
        t[1::13, 1] = float("inf")
    return t


def _steps(seed: int, count: int = 12, size: int = 400) -> list[torch.Tensor]:
    """Skewed steps (a Zipf-like head of hot rows) with a few out-of-range ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = np.minimum(rng.zipf(1.3, size=size) - 1, N - 1)
        ids = rng.permutation(N)[ids]  # hot rows scattered over the table
        ids[rng.integers(0, size, 3)] = [-1, N, N + 17]
        out.append(torch.from_numpy(ids.astype(np.int32)).reshape(-1, 4))
    return out


def _plain(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).to(torch.int64)
    ok = (flat >= 0) & (flat < table.shape[0])
    rows = table[flat.clamp(0, table.shape[0] - 1)]
    rows[~ok] = 0
    return rows.reshape(*ids.shape, table.shape[1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("name", list(DTYPES))
def test_float_rows_are_the_plain_gathers_bit_for_bit(name: str) -> None:
    table = _table(DTYPES[name])
    cache = HotRowCache(table, device="cpu", capacity_rows=150, max_step_rows=1024, admit_budget=40, seed=5)
    assert cache.row_dtype == table.dtype and cache.width == WIDTH
    for ids in _steps(11):
        got = cache.gather(ids)
        assert got.dtype == table.dtype and got.shape == (*ids.shape, WIDTH)
        assert torch.equal(_bits(got), _bits(_plain(table, ids)))
        cache.policy.check_invariants()
    s = cache.stats()
    assert s.hits > 0 and s.fetched > 0 and s.evicted > 0 and s.row_bytes == WIDTH * table.element_size()
    out = torch.empty((400, WIDTH), dtype=table.dtype)
    ids = _steps(12, count=1)[0].reshape(-1)
    assert cache.gather(ids, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(_bits(out), _bits(_plain(table, ids)))


def test_the_policy_does_not_depend_on_the_rows_dtype() -> None:
    """bf16, f16, f32 and FP8 caches (one seed, one capacity) fed the same ids end every
    step in the same state: the same slots, counts and replacements."""
    rng = np.random.default_rng(2)
    fp8 = (
        torch.from_numpy(rng.integers(0, 120, size=(N, 32), dtype=np.uint8)),
        torch.from_numpy(rng.integers(120, 130, size=(N, 1), dtype=np.uint8)),
    )
    kw = dict(device="cpu", capacity_rows=120, max_step_rows=1024, admit_budget=30, seed=9)
    caches = [HotRowCache(_table(d), **kw) for d in DTYPES.values()] + [HotRowCache(*fp8, **kw)]
    for ids in _steps(4):
        states = []
        for c in caches:
            c.gather(ids)
            states.append(c.policy.state())
        for st in states[1:]:
            for key in ("slot_of", "row_of_slot", "counts"):
                assert torch.equal(st[key], states[0][key]), key
            assert (st["filled"], st["evicted"]) == (states[0]["filled"], states[0]["evicted"])
    assert states[0]["evicted"] > 0


def test_misses_fill_free_slots_then_hit() -> None:
    table = _table(torch.float32)
    cache = HotRowCache(table, device="cpu", capacity_rows=64, max_step_rows=256)
    ids = torch.arange(10, 50, dtype=torch.int32)
    cache.gather(ids)
    assert cache.policy.filled == 40 and cache.stats().fetched == 40
    assert torch.equal(cache.work_rows[:40].view(torch.float32), table[10:50])  # slots hold the rows' bytes
    got = cache.gather(ids.flip(0))
    s = cache.stats()
    assert s.hits == 40 and s.fetched == 40  # nothing fetched the second time
    assert torch.equal(got, table[ids.flip(0).long()])


def test_a_full_float_cache_replaces_only_colder_rows() -> None:
    table = _table(torch.bfloat16)
    cache = HotRowCache(table, device="cpu", capacity_rows=4, max_step_rows=64, admit_budget=4, sample_factor=1)
    hot = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    for _ in range(3):
        cache.gather(hot)  # counts 3 each, slots full
    cache.gather(torch.tensor([7, 8, 9, 10], dtype=torch.int32))  # count 1 < 3: no replacement
    assert cache.stats().evicted == 0
    assert sorted(cache.policy.row_of_slot.tolist()) == [0, 1, 2, 3]
    for _ in range(4):
        got = cache.gather(torch.tensor([7, 7, 8, 8], dtype=torch.int32))  # 7 and 8 become hotter than all
        assert torch.equal(got, table[[7, 7, 8, 8]])
    assert {7, 8} <= set(cache.policy.row_of_slot.tolist()) and cache.stats().evicted >= 2


def test_a_warm_start_serves_float_rows_exactly() -> None:
    table = _table(torch.float16)
    counts = np.zeros(N, dtype=np.int64)
    counts[[5, 900, 2999]] = [10, 30, 20]
    cache = HotRowCache(table, device="cpu", capacity_rows=8, max_step_rows=64, initial_counts=counts)
    assert cache.stats().preloaded == 3
    ids = torch.tensor([900, 2999, 5, 5], dtype=torch.int32)
    assert torch.equal(_bits(cache.gather(ids)), _bits(table[ids.long()]))
    assert cache.stats().hits == 3 and cache.stats().fetched == 0


def test_float_rows_take_no_scales() -> None:
    with pytest.raises(EngramError, match="no scales"):
        HotRowCache(_table(torch.float32), torch.zeros(N, 1, dtype=torch.uint8), device="cpu", capacity_rows=1)
    cache = HotRowCache(_table(torch.float32), device="cpu", capacity_rows=1, max_step_rows=8)
    with pytest.raises(EngramError, match="out must be torch.float32"):
        cache.gather(torch.zeros(2, dtype=torch.int32), out=torch.empty(2, WIDTH, dtype=torch.bfloat16))


def _parted_store(table: torch.Tensor) -> TableStore:
    """One layer whose rows are three separate tensors (regions), one plain layer."""
    parts = [table[:1000].clone(), table[1000:1700].clone(), table[1700:].clone()]
    return TableStore([(parts, None), (table.clone(), None)])


@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_store_cache_equals_the_store_gather(name: str) -> None:
    table = _table(DTYPES[name])
    store = _parted_store(table)
    assert len(store.regions(0)) == 3 and len(store.regions(1)) == 1
    plain = StoreGather(store, "cpu")
    cached = CachedStoreGather(store, "cpu", capacity_fraction=0.05, max_step_rows=128, admit_budget=16)
    assert cached.paths == ["cache", "cache"] and plain.paths == ["reference", "reference"]
    for step in _steps(8, count=8):
        ids = step.clamp(0, N - 1).to(torch.int64)  # the model's ids are in the table
        for layer in (0, 1):
            got = cached.gather(layer, ids)  # 400 ids: four cache steps of 128
            assert got.dtype == table.dtype and torch.equal(_bits(got), _bits(plain.gather(layer, ids)))
    stats = cached.stats()
    assert all(s["hits"] > 0 and s["steps"] == 8 * 4 for s in stats)
    with pytest.raises(EngramError, match="row id 3000 is outside table 1"):
        cached.gather(1, torch.tensor([4, N]))
    cached.check_bad_rows()  # refused before the step: nothing reached the sentinel
    cached.caches[0].gather(torch.tensor([N + 5], dtype=torch.int32))  # what an unchecked GPU gather would do
    with pytest.raises(EngramError, match="1 gathered row id\\(s\\) were outside table 0"):
        cached.check_bad_rows()
    cached.close()


def test_store_cache_refuses_what_it_sets_itself() -> None:
    store = _parted_store(_table(torch.float32))
    with pytest.raises(EngramError, match="decay_every"):
        CachedStoreGather(store, "cpu", decay_every=4)
    with pytest.raises(EngramError, match="transfer is set by the store's cache"):
        CachedStoreGather(store, "cpu", transfer=object())
    with pytest.raises(EngramError, match="capacity_fraction must be in"):
        CachedStoreGather(store, "cpu", capacity_fraction=1.5)


def test_engram_config_hot_cache_fraction() -> None:
    assert EngramConfig().hot_cache_fraction == 0.0
    cfg = EngramConfig.parse('{"hot_cache_fraction": 0.05}')
    assert cfg.hot_cache_fraction == 0.05 and "hot_cache_fraction" in cfg.to_json()
    assert EngramConfig.parse(None, {"hot_cache_fraction": "1"}).hot_cache_fraction == 1.0
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(EngramError, match="field 'hot_cache_fraction' must be a number in \\[0, 1\\]"):
            EngramConfig.from_dict({"hot_cache_fraction": bad})
    with pytest.raises(EngramError, match="cpu_offload=false puts the whole tables there already"):
        EngramConfig.from_dict({"hot_cache_fraction": 0.1, "cpu_offload": False}).validate()
    ple_model = SimpleNamespace(engram=None, ple=object())
    EngramConfig.from_dict({"hot_cache_fraction": 0.1}).validate_for(ple_model)
    engram_model = SimpleNamespace(engram=object(), ple=None)
    with pytest.raises(EngramError, match="hot_cache_fraction serves tables a model gathers in its step"):
        EngramConfig.from_dict({"hot_cache_fraction": 0.1}).validate_for(engram_model)
    EngramConfig().validate_for(engram_model)


def _expected() -> dict:
    return json.loads((TINY / "expected.json").read_text())


def test_tiny_qwen4_exp_with_the_cache_gives_the_recorded_tokens() -> None:
    from engram_trt.models.registry import open_checkpoint

    want = _expected()
    ckpt = open_checkpoint(TINY)
    model = ckpt.architecture.load_model(
        ckpt, device="cpu", dtype=torch.float32, engram_config=EngramConfig(hot_cache_fraction=0.3)
    )
    plain = StoreGather(model.ple_tables.store, "cpu")
    served: list[tuple[torch.Tensor, torch.Tensor]] = []
    gather = model.ple_tables.gather

    def spy(layer: int, ids: torch.Tensor, **kw):  # every step's rows against the plain path
        rows = gather(layer, ids, **kw)
        served.append((rows, plain.gather(layer, ids)))
        return rows

    model.ple_tables.gather = spy
    try:
        assert model.ple_tables.paths == ["cache"]
        got = [model.generate_greedy(p, want["new_tokens"], ignore_eos=True) for p in want["prompts"]]
        assert got == want["greedy"]
        assert served and all(torch.equal(a, b) for a, b in served)
        (stats,) = model.ple_tables.cache_stats()
        assert stats["hits"] > 0 and stats["fetched"] > 0 and stats["row_bytes"] == 16  # f32 rows of width 4
    finally:
        model.ple_tables.close()
        ckpt.close()


def test_llm_with_hot_cache_fraction_gives_the_recorded_tokens() -> None:
    from engram_trt import LLM, SamplingParams

    want = _expected()
    with LLM(str(TINY), backend="torch", device="cpu", dtype="fp32", engram_config={"hot_cache_fraction": 0.1}) as llm:
        outs = llm.generate(
            want["prompts"], SamplingParams(max_tokens=want["new_tokens"], temperature=0.0, ignore_eos=True)
        )
        ple = llm.runner.backend.model.ple_tables
        assert ple.paths == ["cache"] and ple.cache_stats()[0]["steps"] > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == want["greedy"]


def test_a_pinned_float_table_gets_the_uva_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole step's UVA share over a float table (no scales): the default where the GPU
    can read the rows (pointer kind stood in: no CUDA driver here), which once asked the
    missing scales for their memory."""
    from engram_trt.native import cache as ck
    from engram_trt.native import library as kernel_library

    words = torch.zeros(64, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(kernel_library, "pointer_kind", lambda t: "host")
    assert ck._uva_share_for(None, 8, True, words, None, "split") == ck.DEFAULT_UVA_SHARE
    monkeypatch.setattr(kernel_library, "pointer_kind", lambda t: "unregistered")
    assert ck._uva_share_for(None, 8, True, words, None, "split") == 0.0
