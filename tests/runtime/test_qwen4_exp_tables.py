"""Qwen4Exp's PLE tables in the Engram table stores (issue 30 item 3), on a CPU.

A tiny random Qwen4Exp saved by transformers (tests/helpers/qwen4_exp.py's
``save_qwen4`` / CASES: two PLE layers of three shards each), then re-saved as two
safetensors files that split each layer's shards between them, so a layer's table is
three regions in two files. Each store (memory, file, shared in a temporary directory,
pinned with a stand-in for CUDA's host registration) must hold exactly the
concatenated shards; the model served from the stores ``--engram-config`` picks gives
transformers' greedy tokens; a damaged shard byte is caught by the sampled check and
the full check, one line each.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.qwen4_exp import CASES, NEW_TOKENS, PROMPTS, hf_greedy, save_qwen4  # noqa: E402
from helpers.tables import FakeRegistrar  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

CASE = "hc4-ple2-interval2"  # PLE on layers 1 and 3, split_ngram_parts=3


def _split_files(folder: Path) -> None:
    """Re-save the checkpoint as two files with an index, each layer's shards split
    between them (shard 1 apart from shards 0 and 2), so no layer is one region."""
    from safetensors.torch import load_file, save_file

    single = folder / "model.safetensors"
    tensors = load_file(str(single))
    a = {k: v for k, v in tensors.items() if ".shard_1." not in k}
    b = {k: v for k, v in tensors.items() if ".shard_1." in k}
    save_file(a, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single.unlink()


@pytest.fixture(scope="module")
def ckpt_folder(tmp_path_factory: Any) -> tuple[Path, Any, dict[int, torch.Tensor]]:
    """(folder, the transformers model, layer index -> its whole table as transformers holds it)."""
    folder = tmp_path_factory.mktemp("ple-tables") / "ck"
    model = save_qwen4(folder, seed=7, **CASES[CASE])
    _split_files(folder)
    tables: dict[int, torch.Tensor] = {}
    for li, layer in enumerate(CASES[CASE]["ple_layer_ids"]):
        emb = model.model.layers[layer - 1].ple.ple_embedding.ngram_embedding
        tables[li] = emb.weight.detach().clone()
    return folder, model, tables


_HF: dict[tuple[int, ...], list[int]] = {}


def hf_tokens(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, computed once per prompt for the module."""
    key = tuple(prompt)
    if key not in _HF:
        _HF[key] = hf_greedy(model, prompt)
    return _HF[key]


def _refs(folder: Path) -> tuple[Any, list[Any]]:
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(folder)
    return ckpt, ckpt.architecture.table_refs(ckpt)


def _whole_tables(folder: Path) -> list[torch.Tensor]:
    """Each PLE layer's shards read with safetensors and concatenated (the independent reference)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = []
    for layer in CASES[CASE]["ple_layer_ids"]:
        names = [
            f"model.layers.{layer - 1}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"
            for i in range(CASES[CASE]["split_ngram_parts"])
        ]
        out.append(torch.cat([tensors[n] for n in names]))
    return out


def test_refs_are_the_shards_in_row_order(ckpt_folder: Any) -> None:
    from engram_trt.tables.source import layer_refs

    folder, _model, hf_tables = ckpt_folder
    ckpt, refs = _refs(folder)
    parts = CASES[CASE]["split_ngram_parts"]
    assert len(refs) == parts * 2 and [r.part for r in refs] == list(range(parts)) * 2
    assert len({r.file for r in refs}) == 2  # the shards lie in two files
    whole = _whole_tables(folder)
    joined = layer_refs(refs)
    for li, (rows, scales) in enumerate(joined):
        assert scales is None and len(rows.regions) == parts
        assert rows.shape == tuple(whole[li].shape) and rows.nbytes == whole[li].numel() * 4 and rows.dtype == "F32"
        assert torch.equal(hf_tables[li], whole[li])  # what transformers holds as one table
    ckpt.close()


def _open(kind: str, refs: list[Any], tmp_path: Path) -> Any:
    from engram_trt.tables.store import open_tables

    if kind == "pinned":  # the whole pinned path but the CUDA call: a stand-in registrar
        from engram_trt.tables.pinned import PinnedTables

        return PinnedTables.load(refs, registrar=FakeRegistrar(), huge_pages="none", progress=False)
    if kind == "shared":
        return open_tables(refs, "shared", progress=False, directory=tmp_path)
    return open_tables(refs, kind, progress=False)


@pytest.mark.parametrize("kind", ["memory", "file", "shared", "pinned"])
def test_each_store_holds_the_concatenated_shards(ckpt_folder: Any, tmp_path: Path, kind: str) -> None:
    from engram_trt.models.qwen4_exp.ple_tables import PLETables

    folder, _model, _hf = ckpt_folder
    ckpt, refs = _refs(folder)
    whole = _whole_tables(folder)
    store = _open(kind, refs, tmp_path)
    try:
        assert store.kind == kind and store.num_layers == 2
        tables = PLETables(store, "cpu", owns_store=False)
        rng = random.Random(3)
        for li, want in enumerate(whole):
            assert store.num_rows(li) == want.shape[0] and store.head_dim(li) == want.shape[1]
            every = torch.arange(want.shape[0])
            assert torch.equal(store.rows(li, every), want)
            ids = torch.tensor([[rng.randrange(want.shape[0]) for _ in range(5)] for _ in range(7)])
            got = tables.gather(li, ids)
            assert got.shape == (7, 5, want.shape[1]) and got.dtype == want.dtype
            assert torch.equal(got, want[ids])
            if kind == "file":  # shards 0 and 2 back to back in one file, shard 1 in the other: two maps
                assert len(store.parts(li)) == 3 and len(store.regions(li)) == 2
                with pytest.raises(EngramError, match="separate regions"):
                    store.tensors(li)
            else:  # one buffer per layer, filled region by region
                rows, _ = store.tensors(li)
                assert torch.equal(rows, want)
        with pytest.raises(EngramError, match=r"row id 10000 is outside table 0"):
            tables.gather(0, torch.tensor([1, 10000]))
        if kind == "shared":  # a second process attaches to the same segment
            again = _open("shared", refs, tmp_path)
            assert not again.created and torch.equal(again.rows(1, torch.arange(whole[1].shape[0])), whole[1])
            again.close()
    finally:
        store.close()
        ckpt.close()


def test_pinned_and_device_stores_need_cuda(ckpt_folder: Any) -> None:
    from engram_trt.tables.store import open_tables

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/gpu/test_qwen4_exp_tables.py covers these stores")
    folder, _model, _hf = ckpt_folder
    ckpt, refs = _refs(folder)
    for kind in ("pinned", "device"):
        with pytest.raises(EngramError, match=f"table storage '{kind}' needs a CUDA device"):
            open_tables(refs, kind, progress=False)
    ckpt.close()


@pytest.mark.parametrize("kind", ["memory", "file", "shared"])
def test_greedy_tokens_from_each_store_equal_transformers(ckpt_folder: Any, tmp_path: Path, kind: str) -> None:
    folder, model, _hf = ckpt_folder
    ckpt, refs = _refs(folder)
    store = _open(kind, refs, tmp_path)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32, tables=store)
    assert ours.ple_tables.store is store and ours.ple_tables.paths == ["reference", "reference"]
    try:
        for prompt in PROMPTS:
            assert ours.generate_greedy(prompt, NEW_TOKENS, ignore_eos=True) == hf_tokens(model, prompt)
    finally:
        store.close()
        ckpt.close()


@pytest.mark.parametrize(
    "ecfg, kind", [(None, "file"), ({"host_file_gather": True}, "file"), ({"cpu_offload": True}, "file")]
)
def test_llm_takes_the_store_engram_config_picks(ckpt_folder: Any, ecfg: Any, kind: str) -> None:
    from engram_trt import LLM, SamplingParams

    folder, model, _hf = ckpt_folder
    want = [hf_tokens(model, p) for p in PROMPTS]
    with LLM(str(folder), backend="torch", device="cpu", dtype="fp32", engram_config=ecfg) as llm:
        storage = llm.storage
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert storage["kind"] == kind and "checkpoint files" in storage["where"]
    assert storage["table_bytes"] == sum(t.numel() * 4 for t in _whole_tables(folder))
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_llm_shared_store_in_a_directory(ckpt_folder: Any, tmp_path: Path) -> None:
    """``dp_shared_memory``: the tables in a shared segment (here a temporary directory
    standing in for /dev/shm), the same tokens."""
    from engram_trt import LLM, SamplingParams

    folder, model, _hf = ckpt_folder
    want = [hf_tokens(model, p) for p in PROMPTS[:1]]
    with LLM(
        str(folder),
        backend="torch",
        device="cpu",
        dtype="fp32",
        engram_config={"dp_shared_memory": True},
        table_options={"directory": str(tmp_path)},
    ) as llm:
        storage = llm.storage
        outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert storage["kind"] == "shared" and str(tmp_path) in storage["where"]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert len(list(tmp_path.glob("engram-trt-*.tables"))) == 1


def test_run_reports_where_the_ple_tables_live(ckpt_folder: Any, capsys: Any) -> None:
    folder, model, _hf = ckpt_folder
    prompt = PROMPTS[0]
    text = " ".join(f"w{i}" for i in prompt)
    args = [
        "run",
        str(folder),
        "--prompt",
        text,
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--ignore-eos",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--engram-config",
        '{"host_file_gather": true}',
    ]
    capsys.readouterr()
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["token_ids"] == hf_tokens(model, prompt) and res["storage"]["kind"] == "file"
    assert main(args) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tables:")]
    assert len(line) == 1 and line[0].startswith("tables:  file,") and "checkpoint files" in line[0], line
    # GPU memory on a CPU: one line, exit 2
    assert main(args[:-1] + ['{"cpu_offload": false}']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cpu_offload=false" in err, err


def test_engram_config_accepts_ple_models_refuses_sharding(ckpt_folder: Any) -> None:
    from engram_trt.config.engram import EngramConfig

    folder, _model, _hf = ckpt_folder
    ckpt, _refs_ = _refs(folder)
    EngramConfig.parse('{"dp_shared_memory": true}').validate_for(ckpt.config)
    EngramConfig.parse('{"host_file_gather": true}').validate_for(ckpt.config)
    with pytest.raises(EngramError, match="embedding_across_dp .* PLE tables"):
        EngramConfig.parse('{"embedding_across_dp": true}').validate_for(ckpt.config)
    ckpt.close()


def test_damaged_shard_byte_caught_by_sampled_and_full_checks(ckpt_folder: Any, tmp_path: Path) -> None:
    """The shards' refs with their hashes (as a manifest records them: the round trip
    keeps each part), a byte of one shard flipped: both checks name that shard, one
    line each; the joined table stays three regions."""
    import shutil

    from engram_trt.tables.source import TableRef, hash_tables, layer_refs, sampled_check, verify_table_hashes

    folder, _model, _hf = ckpt_folder
    copy = tmp_path / "ck"
    shutil.copytree(folder, copy)
    ckpt, refs = _refs(copy)
    ckpt.close()
    hashed = hash_tables(refs, progress=False, block_bytes=256)
    back = [TableRef.from_json(json.loads(json.dumps(r.to_json()))) for r in hashed]
    assert back == hashed and [r.part for r in back] == [r.part for r in refs]
    assert [len(r.regions) for r, _ in layer_refs(back)] == [3, 3]
    assert sampled_check(back, 1 << 30) == [] and verify_table_hashes(back) == []
    victim = back[4]  # layer 1, shard 1 (the second file)
    with open(victim.file, "r+b") as f:
        f.seek(victim.offset + 300)
        b = f.read(1)
        f.seek(victim.offset + 300)
        f.write(bytes([b[0] ^ 0x5A]))
    (sampled,) = sampled_check(back, 1 << 30)
    (full,) = verify_table_hashes(back)
    for line in (sampled, full):
        assert victim.tensor in line and "\n" not in line
    assert "bytes 256..512" in sampled and "sha256 differs" in full
    with pytest.raises(EngramError, match="shard_1.weight"):
        from engram_trt.tables.source import check_table_files

        short = [r if r is not victim else TableRef(**{**vars(r), "nbytes": r.nbytes + 10**9}) for r in back]
        check_table_files(short)


def test_file_store_maps_name_ordered_shards_as_one_region(tmp_path: Path) -> None:
    """12 bf16 shards in one file, where safetensors writes them in name order
    (shard_0, shard_1, shard_10, shard_11, shard_2, ...): one map, rows in table order
    through the part map, equal to the concatenated shards in every store."""
    import struct

    from safetensors.torch import save_file

    from engram_trt.tables.source import TableRef
    from engram_trt.tables.store import open_tables

    gen = torch.Generator().manual_seed(5)
    shards = [(torch.randn(3 + i % 4, 16, generator=gen) * 2).to(torch.bfloat16) for i in range(12)]
    f = tmp_path / "t.safetensors"
    save_file({f"x.shard_{i}.weight": t for i, t in enumerate(shards)} | {"x.other": torch.zeros(3)}, str(f))
    raw = f.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    refs = []
    for i, t in enumerate(shards):
        lo, hi = header[f"x.shard_{i}.weight"]["data_offsets"]
        refs.append(
            TableRef(0, 0, "rows", f"x.shard_{i}.weight", f, 8 + hlen + lo, hi - lo, tuple(t.shape), "BF16", part=i)
        )
    offsets = [r.offset for r in refs]
    assert offsets != sorted(offsets)  # the file is not in row order
    whole = torch.cat(shards)
    for kind in ("file", "memory"):
        store = open_tables(refs, kind, progress=False)
        if kind == "file":
            assert len(store.regions(0)) == 1 and len(store.parts(0)) == 12
        ids = torch.randint(0, whole.shape[0], (40,), generator=gen)
        assert torch.equal(store.rows(0, ids), whole[ids]) and store.rows(0, ids).dtype == torch.bfloat16
        assert torch.equal(torch.cat([t for _, t in store.parts(0)]), whole)
        store.close()
