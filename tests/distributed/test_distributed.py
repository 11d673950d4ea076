"""Several ranks: the sharding arithmetic against the single-rank layout, the exchange
order simulated in one process, the sharded lookup on real gloo process groups of 2
and 4 ranks (rows bit for bit equal to the unsharded ``TableStore.rows``), and greedy
tokens of TP=2 and DP=2 (every table-sharing mode) equal to one process's ``LLM``.

Spawned ranks import torch (seconds each on a small machine), so each world size is
started once and runs every case of its size.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engram_trt.config.engram import EngramConfig
from engram_trt.distributed.checks import LookupCase, case_lookback
from engram_trt.distributed.modes import choose_table_sharing, shared_store_problem
from engram_trt.distributed.sharding import (
    Topology,
    all_shards,
    balanced_ranges,
    column_owners,
    column_ranges,
    exchange_plan,
    global_row_ids,
    local_row_ids,
    max_shard_cols,
    pad_row_ids,
    pad_token_count,
    shard_columns,
    slice_table_refs,
)
from engram_trt.engram.hashing import hash_batch_packed
from engram_trt.errors import EngramError
from engram_trt.models.step import PackedStep


@pytest.fixture(scope="module")
def source(small_engine):
    from engram_trt.runtime.engine_folder import open_model_source

    return open_model_source(small_engine, progress=False)


@pytest.fixture(scope="module")
def full_tables(source):
    """The unsharded reference: every table whole in host memory."""
    from engram_trt.tables.store import open_tables

    with open_tables(source.table_refs, "memory", quant_block=source.config.engram.quant_block, progress=False) as t:
        yield t


def reference_rows(source, full_tables, seqs, lookback) -> np.ndarray:
    """uint16 bits ``[L, T, cols, D]`` of the unsharded lookup of one replica's step."""
    step = PackedStep.from_sequences([list(s) for s in seqs])
    cids = source.compress_lookup[step.input_ids.numpy()]
    ids = torch.from_numpy(hash_batch_packed(cids, step.seq_starts, lookback, source.layout))
    rows = torch.stack([full_tables.rows(li, ids[:, li, :]) for li in range(source.layout.num_layers)])
    return rows.view(torch.int16).numpy().view(np.uint16)


# -- the arithmetic ---------------------------------------------------------------------
@pytest.mark.parametrize("n,parts", [(4, 1), (4, 2), (4, 3), (4, 4), (4, 5), (16, 6), (0, 2), (7, 7), (33, 8)])
def test_balanced_ranges_are_contiguous_cover_all_and_differ_by_one(n, parts):
    got = balanced_ranges(n, parts)
    assert len(got) == parts and got[0][0] == 0 and got[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # contiguous, in rank order
    sizes = [e - b for b, e in got]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # the first ranks take the extra
    owners = column_owners(n, parts)
    for r, (b, e) in enumerate(got):
        assert (owners[b:e] == r).all()
    assert max_shard_cols(n, parts) == -(-n // parts)


def test_balanced_ranges_refuse_no_parts():
    with pytest.raises(EngramError, match="at least one part"):
        balanced_ranges(4, 0)


def test_column_ranges_of_known_sizes():
    assert column_ranges(16, 3) == [(0, 6), (6, 11), (11, 16)]
    assert column_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert column_ranges(4, 6) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 4), (4, 4)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shards_own_exactly_their_columns_rows(source, world):
    """Each shard's row range is its columns' prime-sized slices back to back; the
    shards tile every layer's table from row 0 to table_rows, in rank order."""
    L = source.layout
    shards = all_shards(L, world)
    for li in range(L.num_layers):
        end = 0
        for s in shards:
            assert s.row_begin[li] == end
            want = sum(int(L.col_primes[li, c]) for c in range(s.col_begin, s.col_end))
            assert s.num_rows(li) == want
            if not s.is_empty:
                assert s.row_begin[li] == int(L.offsets[li, s.col_begin])
            end = s.row_end[li]
        assert end == int(L.table_rows[li])
    assert sum(s.num_cols for s in shards) == L.n_hash_cols


def test_row_remap_lands_in_the_slice_and_inverts(source):
    L = source.layout
    rng = np.random.default_rng(7)
    ids = rng.integers(0, len(source.compress_lookup), size=50)
    cids = source.compress_lookup[ids]
    glob = hash_batch_packed(cids, [0, 20, 50], None, L)  # [T, L, cols]
    for world in (2, 3, 4):
        for s in all_shards(L, world):
            loc = local_row_ids(glob, s)
            assert loc.shape == (50, L.num_layers, s.num_cols)
            for li in range(L.num_layers):
                assert loc[:, li].min(initial=0) >= 0 and loc[:, li].max(initial=-1) < s.num_rows(li)
                # column c's rows [offset_c, offset_c + prime_c) map to [offset_c - begin, ...)
                for k, c in enumerate(range(s.col_begin, s.col_end)):
                    lo = int(L.offsets[li, c]) - s.row_begin[li]
                    assert (loc[:, li, k] >= lo).all() and (loc[:, li, k] < lo + int(L.col_primes[li, c])).all()
            assert np.array_equal(global_row_ids(loc, s), glob[..., s.col_begin : s.col_end])


@pytest.mark.parametrize(
    "n,cap,want",
    [(0, 64, 0), (1, 64, 1), (2, 64, 2), (3, 64, 4), (17, 64, 32), (33, 64, 64), (64, 64, 64), (40, 48, 48)],
)
def test_pad_token_count_buckets(n, cap, want):
    assert pad_token_count(n, cap) == want


def test_pad_token_count_refuses_an_oversized_step():
    with pytest.raises(EngramError, match="max_num_tokens"):
        pad_token_count(65, 64)


def test_pad_rows_read_each_columns_first_row(source):
    L = source.layout
    ids = hash_batch_packed(source.compress_lookup[np.arange(3)], [0, 3], None, L)
    out = pad_row_ids(ids, 8, L)
    assert out.dtype == np.int32 and out.shape == (8, L.num_layers, L.n_hash_cols)
    assert np.array_equal(out[:3], ids)
    assert (out[3:] == L.offsets.astype(np.int32)[None]).all()
    assert np.array_equal(pad_row_ids(None, 2, L)[1], L.offsets)


def test_topology_numbering():
    t = Topology(tp=2, dp=3)
    assert t.world == 6 and [t.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [t.leader_of(r) for r in range(6)] == [0, 0, 2, 2, 4, 4]
    assert t.tp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert t.split_prompts(7) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(EngramError, match="--tp must be an integer >= 1"):
        Topology(tp=0)


def test_exchange_plans():
    t = Topology(tp=2, dp=2)
    w = exchange_plan(t, 3, "world", 4)
    assert w.members == (0, 1, 2, 3) and w.me == 3 and w.exchanges_ids
    assert w.requesters == (0, 2) and w.replica_of == (0, 0, 1, 1) and w.send_order() == [0, 0, 1, 1]
    assert w.col_ranges == ((0, 1), (1, 2), (2, 3), (3, 4)) and w.assemble_order() == [
        (0, 0, 1),
        (1, 1, 2),
        (2, 2, 3),
        (3, 3, 4),
    ]
    p = exchange_plan(t, 3, "tp", 4)
    assert p.members == (2, 3) and p.me == 1 and not p.exchanges_ids and p.col_ranges == ((0, 2), (2, 4))
    assert exchange_plan(Topology(1, 3), 1, "world", 4).col_ranges == ((0, 2), (2, 3), (3, 4))
    assert exchange_plan(Topology(1, 6), 5, "world", 4).assemble_order() == [(0, 0, 1), (1, 1, 2), (2, 2, 3), (3, 3, 4)]


def test_slice_refs_load_only_the_slice(source, full_tables):
    """A store over the sliced refs (memory copy and file map alike) holds exactly rows
    [row_begin, row_end) of each table and its scales."""
    from engram_trt.tables.store import open_tables

    qb = source.config.engram.quant_block
    for s in all_shards(source.layout, 3):
        refs = slice_table_refs(source.table_refs, s)
        assert sum(r.nbytes for r in refs) < sum(r.nbytes for r in source.table_refs)
        for kind in ("memory", "file"):
            with open_tables(refs, kind, quant_block=qb, progress=False) as part:
                for li in range(source.layout.num_layers):
                    rows, scales = part.tensors(li)
                    frows, fscales = full_tables.tensors(li)
                    b, e = s.row_begin[li], s.row_end[li]
                    assert torch.equal(rows, frows[b:e]) and torch.equal(scales, fscales[b:e])


def test_exchange_order_simulated_in_one_process(source, full_tables):
    """Every rank of a 2 x 2 world (and a 1 x 3 one) gathers its columns for every
    replica from its own slice, the chunks are routed as the all-to-all would route
    them, and each replica's assembled rows equal the unsharded lookup, bit for bit."""
    from engram_trt.tables.store import open_tables

    L = source.layout
    rng = np.random.default_rng(3)
    for topo in (Topology(2, 2), Topology(1, 3)):
        steps = [[list(rng.integers(0, 5000, size=n)) for n in (5, 2)] for _ in range(topo.dp)]  # per replica 2 seqs
        ids = [hash_batch_packed(source.compress_lookup[np.concatenate(s)], [0, 5, 7], None, L) for s in steps]
        P = pad_token_count(7, 64)
        padded = np.stack([pad_row_ids(i, P, L) for i in ids])  # the all-gathered ids [dp, P, L, cols]
        sent = {}
        for r in range(topo.world):
            plan = exchange_plan(topo, r, "world", L.n_hash_cols)
            s = shard_columns(L, plan.me, plan.size)
            with open_tables(
                slice_table_refs(source.table_refs, s), "memory", quant_block=full_tables.quant_block, progress=False
            ) as part:
                local = local_row_ids(padded, s)  # [R, P, L, nc]
                rows = torch.stack(
                    [
                        part.rows(li, torch.from_numpy(local[:, :, li, :].astype(np.int64)))
                        for li in range(L.num_layers)
                    ],
                    1,
                )  # [R, L, P, nc, D]
            for d, rep in enumerate(plan.send_order()):
                sent[(r, d)] = rows[rep]
        for d in range(topo.world):
            plan = exchange_plan(topo, d, "world", L.n_hash_cols)
            out = torch.empty((L.num_layers, 7, L.n_hash_cols, full_tables.head_dim(0)), dtype=torch.bfloat16)
            for src_rank, b, e in plan.assemble_order():
                out[:, :, b:e] = sent[(src_rank, d)][:, :7]
            want = torch.stack(
                [
                    full_tables.rows(li, torch.from_numpy(ids[topo.replica_of(d)][:, li, :]))
                    for li in range(L.num_layers)
                ]
            )
            assert torch.equal(out, want)


# -- the mode choice -----------------------------------------------------------------
def test_table_sharing_choices_and_fallbacks():
    across, shared, private = (
        EngramConfig(embedding_across_dp=True),
        EngramConfig(dp_shared_memory=True),
        EngramConfig(),
    )
    s = choose_table_sharing(across, Topology(2, 2))
    assert (s.scope, s.dp_mode, s.copies(Topology(2, 2)), s.warnings) == ("world", "embedding_across_dp", 1, ())
    s = choose_table_sharing(across, Topology(2, 1))
    assert (s.scope, s.dp_mode) == ("tp", "single")
    s = choose_table_sharing(shared, Topology(1, 2))
    assert (s.scope, s.dp_mode, s.engram_config.dp_shared_memory) == (None, "dp_shared_memory", True)
    s = choose_table_sharing(shared, Topology(2, 2))
    assert (s.scope, s.dp_mode) == ("tp", "dp_shared_memory")  # TP slices, one segment per slice
    s = choose_table_sharing(private, Topology(1, 3))
    assert (s.scope, s.dp_mode, s.copies(Topology(1, 3))) == (None, "private", 3)
    # Fallbacks, each with its warning.
    s = choose_table_sharing(shared, Topology(1, 2), shared_problem="no /dev/shm here")
    assert s.dp_mode == "embedding_across_dp" and s.scope == "world" and "no /dev/shm here" in s.warnings[0]
    assert not s.engram_config.dp_shared_memory and s.engram_config.embedding_across_dp
    s = choose_table_sharing(shared, Topology(1, 2), staged_rows_ok=False, shared_problem="missing")
    assert s.dp_mode == "private" and "private copy" in s.warnings[0]
    s = choose_table_sharing(across, Topology(1, 2), staged_rows_ok=False)
    assert s.dp_mode == "dp_shared_memory" and s.scope is None and "in_engine" in s.warnings[0]
    s = choose_table_sharing(
        EngramConfig(embedding_across_dp=True, cpu_offload=False), Topology(1, 2), staged_rows_ok=False
    )
    assert s.dp_mode == "private"  # a shared copy needs host tables
    s = choose_table_sharing(across, Topology(1, 1))
    assert s.dp_mode == "single" and s.scope is None and "single rank" in s.warnings[0]
    with pytest.raises(EngramError, match="table_placement prefetch"):
        choose_table_sharing(private, Topology(2, 1), staged_rows_ok=False)


def test_shared_store_problem_names_what_is_missing(tmp_path):
    import importlib.util

    got = shared_store_problem(tmp_path / "nowhere")
    if importlib.util.find_spec("engram_trt.tables.shared") is None:
        assert "not part of this installation" in got
    else:
        assert "does not exist" in got
        assert shared_store_problem(tmp_path) is None


# -- real process groups (gloo) -----------------------------------------------------------
def _random_steps(seed: int, dp: int, shapes) -> tuple:
    """``shapes[k][replica]``: sequence lengths of that replica in step k ([] = idle)."""
    rng = np.random.default_rng(seed)
    return tuple(
        tuple(tuple(tuple(int(x) for x in rng.integers(0, 120000, size=n)) for n in shapes[k][d]) for d in range(dp))
        for k in range(len(shapes))
    )


def _lookup_cases(world: int) -> list[LookupCase]:
    if world == 2:
        return [
            LookupCase(2, 1, "tp", _random_steps(1, 1, [[[3, 1]], [[1, 1, 1]], [[64]]]), 1),
            LookupCase(1, 2, "world", _random_steps(2, 2, [[[3, 1], [5]], [[1], []], [[], [17, 2]], [[64], [1]]]), 2),
        ]
    return [
        LookupCase(4, 1, "tp", _random_steps(3, 1, [[[2, 5]], [[1]]]), 3),
        LookupCase(
            1, 4, "world", _random_steps(4, 4, [[[3], [1, 1], [], [9]], [[], [], [2], []], [[1], [40], [1], [1]]]), 4
        ),
        LookupCase(2, 2, "world", _random_steps(5, 2, [[[6], [1, 2]], [[], [33]]]), 5),
        LookupCase(2, 2, "tp", _random_steps(6, 2, [[[4], [1]], [[2, 2], [7]]]), 6),
    ]


def _check_lookup_results(source, full_tables, cases, results) -> None:
    L = source.layout
    n = L.max_ngram_size - 1
    for case, per_rank in zip(cases, results):
        topo = Topology(case.tp, case.dp)
        assert len(per_rank) == topo.world
        for rank, got in enumerate(per_rank):
            rep = topo.replica_of(rank)
            plan = exchange_plan(topo, rank, case.scope, L.n_hash_cols)
            assert got["shard"] == shard_columns(L, plan.me, plan.size).to_json()
            assert got["env"] == {
                "NCCL_NVLS_ENABLE": "0",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1",
            }
            for k, step in enumerate(case.steps):
                seqs = step[rep]
                if not seqs:
                    assert got["steps"][k] is None
                    continue
                lb = case_lookback(case, k, rep, len(seqs), n, L.compressed_vocab_size)
                want = reference_rows(source, full_tables, seqs, lb)
                assert want.any()  # real rows, not zeros
                assert got["steps"][k].shape == want.shape and np.array_equal(got["steps"][k], want), (
                    f"{case.scope} tp{case.tp} dp{case.dp} rank {rank} step {k}"
                )
            if case.scope == "world" and any(not step[rep] for step in case.steps):
                assert got["stats"]["idle_steps"] >= 1


PROMPTS = [
    "Engram layers look up n-grams in",
    "The quick brown fox jumps over the lazy dog",
    " ".join(["Tables of hashed n-grams sit outside the engine, sharded by columns over the ranks."] * 6),
]


def _params():
    from engram_trt.runtime.sampling_params import SamplingParams

    # Different lengths: the replicas finish at different steps, so one idles while the other steps.
    return [
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True),
        SamplingParams(max_tokens=9, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def reference_tokens(small_engine):
    from engram_trt import LLM

    with LLM(str(small_engine), backend="torch", device="cpu", progress=False) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, _params())]


def test_two_ranks_lookup_and_greedy_tokens(small_engine, source, full_tables, reference_tokens, tmp_path):
    """One gloo world of 2 ranks: the lookup cases of 2 ranks, then TP=2, DP=2 with
    embedding_across_dp, DP=2 asking for dp_shared_memory (the shared store when it
    is installed, else the fallback to embedding_across_dp) and DP=2 private copies:
    every mode's greedy tokens equal one process's."""
    from engram_trt.distributed.checks import lookup_check, replica_jobs, run_sequence
    from engram_trt.distributed.launch import ReplicaJob, spawn

    assert len(source.compress_lookup) > 120000
    cases = _lookup_cases(2)
    kw = {"backend": "torch", "progress": False}
    shm = tmp_path / "shm"
    shm.mkdir()
    jobs = [
        ReplicaJob(str(small_engine), 2, 1, PROMPTS, _params(), None, dict(kw)),
        ReplicaJob(
            str(small_engine),
            1,
            2,
            PROMPTS,
            _params(),
            EngramConfig(embedding_across_dp=True),
            dict(kw),
            measure_memory=True,
        ),
        ReplicaJob(
            str(small_engine),
            1,
            2,
            PROMPTS,
            _params(),
            EngramConfig(dp_shared_memory=True),
            dict(kw, table_options={"directory": str(shm)}),
        ),
        ReplicaJob(str(small_engine), 1, 2, PROMPTS, _params(), None, dict(kw)),
    ]
    lookups, served = spawn(
        2,
        run_sequence,
        [(lookup_check, (str(small_engine), cases)), (replica_jobs, (jobs,))],
        device_kind="cpu",
        timeout_s=180,
    )
    _check_lookup_results(source, full_tables, cases, lookups)
    modes = [r["sharing"]["dp_mode"] for r in served]
    import importlib.util

    shared_there = importlib.util.find_spec("engram_trt.tables.shared") is not None
    assert modes == [
        "single",
        "embedding_across_dp",
        "dp_shared_memory" if shared_there else "embedding_across_dp",
        "private",
    ]
    if not shared_there:
        assert "not part of this installation" in served[2]["sharing"]["warnings"][0]
    for job, res in zip(jobs, served):
        got = [o.token_ids for o in res["outputs"]]
        assert got == reference_tokens, f"tp {job.tp} dp {job.dp} {res['sharing']['dp_mode']}"
        assert all(o.error is None for o in res["outputs"])
    tp, across = served[0], served[1]
    # TP: each rank holds half the columns, the follower ran every step of the leader.
    assert [r["storage"]["shard"]["columns"] for r in tp["ranks"]] == [[0, 2], [2, 4]]
    assert tp["ranks"][1]["stats"]["follower_steps"] == tp["ranks"][0]["stats"]["steps"] > 0
    half = [r["storage"]["table_bytes"] for r in across["ranks"]]
    assert sum(half) == sum(r.nbytes for r in source.table_refs)  # one copy over the two ranks
    assert max(r["stats"]["idle_steps"] for r in across["ranks"]) >= 1  # a replica with no work took part
    assert sum(r["stats"]["engram"]["idle_steps"] for r in across["ranks"]) >= 1
    assert len({r["memory"]["pid"] for r in across["ranks"]}) == 2 and all(
        r["memory"]["pss_bytes"] > 0 for r in across["ranks"]
    )
    private = served[3]
    assert all(r["storage"]["table_bytes"] == sum(x.nbytes for x in source.table_refs) for r in private["ranks"])


def test_four_ranks_lookup(small_engine, source, full_tables):
    """A gloo world of 4: TP=4, DP=4 and 2x2 (world scope and per-replica TP scope);
    rows bit for bit equal to the unsharded store's, idle replicas included."""
    from engram_trt.distributed.checks import lookup_check
    from engram_trt.distributed.launch import spawn

    cases = _lookup_cases(4)
    results = spawn(4, lookup_check, str(small_engine), cases, device_kind="cpu", timeout_s=180)
    _check_lookup_results(source, full_tables, cases, results)


# -- the command line --------------------------------------------------------------------
def test_cli_prompts_file_one_rank(small_engine, reference_tokens, tmp_path, capsys):
    from engram_trt.cli.main import main

    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS[:2]))
    code = main(
        [
            "run",
            str(small_engine),
            "--prompts-file",
            str(f),
            "--backend",
            "torch",
            "--device",
            "cpu",
            "--max-new-tokens",
            "3",
            "--ignore-eos",
            "--json",
        ]
    )
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and (res["tp"], res["dp"], res["tables"]["dp_mode"]) == (1, 1, "single")
    assert [r["token_ids"] for r in res["results"]] == [t[:3] for t in reference_tokens[:2]]


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--tp", "0"], "--tp must be >= 1"),
        (["--dp", "2", "--device", "cuda:1"], "each rank takes its own GPU"),
    ],
)
def test_cli_refuses_bad_rank_options(small_engine, capsys, argv, msg):
    from engram_trt.cli.main import main

    code = main(["run", str(small_engine), "--backend", "torch", *argv])
    err = capsys.readouterr().err
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_cuda_ranks_without_a_gpu(small_engine, capsys):
    from engram_trt.cli.main import main

    code = main(["run", str(small_engine), "--tp", "2", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "no CUDA device is available" in err


def test_disable_multicast_overrides_a_set_value():
    from engram_trt.distributed.groups import NO_MULTICAST_ENV, disable_multicast

    env = {"NCCL_NVLS_ENABLE": "1"}
    disable_multicast(env)
    assert (
        env
        == NO_MULTICAST_ENV
        == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    )


def test_gpu_distributed_check_imports():
    """tests/gpu/test_distributed_x2.py (the 2-GPU check) imports here, without a GPU."""
    import importlib

    mod = importlib.import_module("gpu.test_distributed_x2")
    assert callable(mod.test_lookup_rows) and callable(mod.test_serving_group)
