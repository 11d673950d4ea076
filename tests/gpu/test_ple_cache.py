"""The hot-row cache serving float rows (bf16 / f16 / f32: Qwen4Exp's PLE tables) on a GPU.

1. The CUDA cache (fused plan and admission kernels, ``cacheKernel.cu``; the whole step
   in one library call, and phase by phase) over bf16, f16 and f32 host tables (f32 rows
   whose low halves are bf16 NaN / inf bit patterns: a conversion anywhere would show),
   pinned (a share of large steps' misses read through UVA) and pageable: every step's
   rows bit-equal to torch indexing of the table (zero rows for out-of-range ids) and to
   the host gather of its bf16 words, and the policy's whole state equal to the CPU
   reference policy given the kernels' miss order (``test_cache.compare_steps``).
2. :class:`CachedStoreGather` on CUDA over a bf16 table in pinned memory and a memory
   store whose f32 layer is three regions: the same rows as :class:`StoreGather`; unchecked GPU
   ids with a bad one counted by the sentinel row (``check_bad_rows`` raises).
3. The tiny Qwen4Exp (tests/data/qwen4_exp_tiny, f32 PLE rows) on CUDA with
   ``hot_cache_fraction``: the recorded greedy tokens (transformers', tied on the CPU)
   through the model and through ``LLM`` (decode CUDA graphs, lookup before the replay).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from .helpers import REPO, special_float_table
from .test_cache import compare_steps

DATA = REPO / "tests" / "data" / "qwen4_exp_tiny"
N = 60_000


def _table(torch: Any, dtype: Any, width: int, seed: int) -> Any:
    return special_float_table(torch, dtype, N, width, seed, inf_column=1)


def _plain(torch: Any, table: Any, ids: Any) -> Any:
    flat = ids.reshape(-1).to(torch.int64)
    ok = (flat >= 0) & (flat < table.shape[0])
    rows = table[flat.clamp(0, table.shape[0] - 1)]
    rows[~ok] = 0
    return rows


# (name, dtype, width, pinned, whole step)
FLOAT_ROW_CASES = [
    ("bf16", "bfloat16", 128, True, True),
    ("f16", "float16", 128, False, True),
    ("f32", "float32", 64, True, True),
    ("f32", "float32", 64, False, False),
    ("f32 narrow", "float32", 4, False, True),
]


@pytest.mark.parametrize("k", range(len(FLOAT_ROW_CASES)))
def test_cuda_cache_of_float_rows(dev, k) -> None:
    """One case's cache: its rows and policy against the host gather and the CPU reference
    over 8 steps, then 4 small steps bit for bit against torch indexing (consecutive
    asserts: the one cache's state carries from the first check to the second)."""
    import torch

    from engram_trt.cache.hotcache import HotRowCache, as_words
    from engram_trt.cache.policy import CachePolicy
    from engram_trt.native.hostgather import HostGatherer

    g = HostGatherer(device=dev, max_head_dim=512)
    rng = np.random.default_rng([5, k])
    name, dtype_name, width, pinned, whole = FLOAT_ROW_CASES[k]
    dtype = getattr(torch, dtype_name)
    table = _table(torch, dtype, width, seed=k)
    if pinned:
        table = table.pin_memory()
    words = as_words(table)
    kw = dict(capacity_rows=3_000, max_step_rows=40_000, admit_budget=1_000, admit_every=1, seed=k)
    cache = HotRowCache(table, device=dev, gatherer=g, whole_step=whole, **kw)
    ref = CachePolicy(N, 3_000, device="cpu", admit_budget=1_000, seed=k, fused=False, max_step_rows=40_000)
    # big steps (>= 8192 misses) so that a pinned table's whole step reads a share through UVA
    big = lambda: ((rng.zipf(1.15, size=(1_500, 24)) * 7919) % N).astype(np.int32)  # noqa: E731
    ok, why, whole_steps, misses = compare_steps(dev, cache, ref, g, (words, None), "split", big, 8, 32)
    exact = True
    for _ in range(4):
        sid = torch.from_numpy(((rng.zipf(1.2, size=(700, 16)) * 7919) % N).astype(np.int32))
        sid[0, :3] = torch.tensor([-1, N, N + 7], dtype=torch.int32)
        got = cache.gather(sid.to(dev))
        torch.cuda.synchronize(dev)
        want = _plain(torch, table, sid)
        exact &= got.dtype == dtype and torch.equal(
            got.reshape(-1, width).cpu().view(torch.int16), want.view(torch.int16)
        )
    cache.policy.check_invariants()
    s = cache.stats()
    label = f"{name} rows [{N}, {width}], {'pinned' if pinned else 'pageable'}, {'whole step' if whole else 'phases'}"
    assert ok, f"CUDA cache of {label}: rows == host gather and policy == CPU reference, 8 steps: " + (
        why
        or f"misses per step {misses}, whole steps {whole_steps}, UVA share "
        f"{getattr(cache._whole_step, 'uva_share', 0.0)}"
    )
    assert exact and s.hits > 0 and s.evicted > 0, (
        f"CUDA cache of {label}: rows == torch indexing bit for bit, hits and replacements: "
        f"hit rate {s.hit_rate:.1%}, fetched / lookups {s.fetch_fraction:.1%}, evicted {s.evicted}, "
        f"row bytes {s.row_bytes}"
    )
    cache.close()
    g.close()


def test_store_cache_on_cuda(dev) -> None:
    import torch

    from engram_trt.cache.storecache import CachedStoreGather
    from engram_trt.tables.base import TableStore
    from engram_trt.tables.rowgather import StoreGather

    t32 = _table(torch, torch.float32, 32, seed=11)
    t16 = _table(torch, torch.bfloat16, 64, seed=12)
    parted = TableStore(
        [([t32[:20_000].clone(), t32[20_000:45_000].clone(), t32[45_000:].clone()], None), (t16.clone(), None)]
    )
    pinned = TableStore([(t16.pin_memory(), None)])
    rng = np.random.default_rng(9)
    for label, store in (
        ("memory store, a layer in 3 regions + a bf16 layer", parted),
        ("a bf16 table in pinned memory", pinned),
    ):
        plain = StoreGather(store, dev)
        cached = CachedStoreGather(store, dev, capacity_fraction=0.05, max_step_rows=8_192)
        ok = cached.paths == ["cache"] * store.num_layers
        for _ in range(6):
            ids = torch.from_numpy(((rng.zipf(1.2, size=(600, 16)) * 7919) % N).astype(np.int64))
            for layer in range(store.num_layers):
                got = cached.gather(layer, ids)  # 9,600 ids: two cache steps
                want = plain.gather(layer, ids)
                torch.cuda.synchronize(dev)
                ok &= got.dtype == want.dtype and torch.equal(got.cpu().view(torch.int16), want.cpu().view(torch.int16))
        stats = cached.stats()
        assert ok and all(s["hits"] > 0 for s in stats), (
            f"CachedStoreGather on CUDA == StoreGather: {label}: paths {cached.paths} (plain {plain.paths}); hit rates "
            f"{[round(s['hit_rate'], 3) for s in stats]}"
        )
        bad = torch.tensor([3, N + 1], dtype=torch.int32, device=dev)
        cached.gather(0, bad, checked=False)
        try:
            cached.check_bad_rows()
            raised = ""
        except Exception as exc:  # noqa: BLE001 - the message is the check
            raised = str(exc)
        assert "1 gathered row id(s) were outside table 0" in raised, (
            f"unchecked GPU ids: a bad id is counted and check_bad_rows raises ({label}): {raised}"
        )
        cached.close()
        plain.close()


@pytest.fixture(scope="module")
def expected():
    return json.loads((DATA / "expected.json").read_text())


def test_tiny_qwen4_exp_with_the_cache_on_cuda(expected) -> None:
    import torch

    from engram_trt import LLM, SamplingParams
    from engram_trt.config.engram import EngramConfig
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(DATA)
    model = ckpt.architecture.load_model(
        ckpt, device="cuda", dtype=torch.float32, engram_config=EngramConfig(hot_cache_fraction=0.3)
    )
    assert model.ple_tables.paths == ["cache"], (
        f"tiny Qwen4Exp on CUDA with hot_cache_fraction: the PLE layer is cached: paths {model.ple_tables.paths}, "
        f"store {model.ple_tables.kind}"
    )
    for i, prompt in enumerate(expected["prompts"]):
        got = model.generate_greedy(prompt, expected["new_tokens"], chunk=4, ignore_eos=True)
        assert got == expected["greedy"][i], (
            f"prompt {i}: fp32 CUDA greedy tokens through the cache: {got} vs {expected['greedy'][i]}"
        )
    (stats,) = model.ple_tables.cache_stats()
    assert stats["hits"] > 0, "the cache served hits: " + json.dumps(
        {k: stats[k] for k in ("steps", "hits", "fetched")}
    )
    model.ple_tables.close()
    ckpt.close()
    with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32", engram_config={"hot_cache_fraction": 0.2}) as llm:
        outs = llm.generate(
            expected["prompts"], SamplingParams(max_tokens=expected["new_tokens"], temperature=0.0, ignore_eos=True)
        )
        ple = llm.runner.backend.model.ple_tables
        paths, graphs = ple.paths, llm.runner.backend.graphs
        replays = getattr(graphs, "replays", 0)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected["greedy"] and paths == ["cache"], (
        f"LLM on CUDA with hot_cache_fraction: recorded greedy tokens: {got}; paths {paths}; decode graph replays "
        f"{replays}"
    )
