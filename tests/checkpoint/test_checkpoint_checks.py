"""What a checkpoint's bytes hold, checked before they are served: NaN / Inf in any
weight or table (inspect lists them, build and import-gguf refuse them, and a step whose
logits are not finite ends that request with an error instead of a token drawn from
garbage), and the tokenizer run and serve will need (build refuses a missing or broken
one unless ``--token-ids-only``).

The references are independent of the scanner: torch's own decoding of every stored
format (``.float()`` of the raw bytes viewed as that dtype) for the counts, and the
clean folder's own tokens for the requests a NaN must not touch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.files import REPO, tree_digest
from engram_trt.checkpoint.nonfinite import SAMPLE_BLOCK, Region, scan_regions
from engram_trt.cli.main import main

DATA = REPO / "tests" / "data"
GEN = ["--max-new-tokens", "3", "--device", "cpu", "--prompt", "w1 w2 w3"]

# safetensors dtype -> torch dtype the reference decodes with
FORMATS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, edit: Any, shard: str = "model.safetensors") -> None:
    d = load_file(str(folder / shard))
    edit(d)
    save_file(d, str(folder / shard), metadata={"format": "pt"})


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> None:
    assert err.startswith("engram-trt: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


# ---------------------------------------------------------------- the scanner
def test_scan_counts_nan_and_inf_of_every_format_as_torch_decodes_them(tmp_path: Path) -> None:
    """Random bytes (every bit pattern likely) in each stored format: the NaN / Inf counts
    and the first index equal what torch reads from the same bytes; integer tensors are
    not float tensors and are skipped."""
    rng = np.random.default_rng(7)
    tensors: dict[str, torch.Tensor] = {}
    for st, dt in FORMATS.items():
        item = torch.tensor([], dtype=dt).element_size()
        raw = rng.integers(0, 256, size=4099 * item, dtype=np.uint8)
        if item >= 2:  # make non-finite patterns common: set the exponent bits of every 7th element
            words = raw.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[item])
            top = {
                torch.float16: 0x7C00,
                torch.bfloat16: 0x7F80,
                torch.float32: 0x7F800000,
                torch.float64: 0x7FF0000000000000,
            }[dt]
            words[::7] |= np.array(top, dtype=words.dtype)
        tensors[st] = torch.from_numpy(raw.copy()).view(dt)
    tensors["ints"] = torch.from_numpy(rng.integers(0, 256, size=512, dtype=np.uint8).copy()).view(torch.int8)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    from engram_trt.checkpoint.files import _tensor_infos

    infos = _tensor_infos(tmp_path / "m.safetensors")
    regions = [Region(n, i.file, i.data_offset, i.nbytes, i.st_dtype) for n, i in infos.items()]
    res = scan_regions(regions, budget_bytes=None)
    assert res.full and res.tensors == len(FORMATS) and res.bytes_read == res.bytes_total
    found = {f.name: f for f in res.findings}
    for st, dt in FORMATS.items():
        ref = tensors[st].float() if dt != torch.float64 else tensors[st]
        nan, inf = int(torch.isnan(ref).sum()), int(torch.isinf(ref).sum())
        assert nan + inf > 0, st  # the case means something
        f = found[st]
        assert (f.nan, f.inf) == (nan, inf), st
        assert f.first == int(torch.nonzero(~torch.isfinite(ref))[0]), st
    assert "ints" not in found


def test_sampled_scan_stays_within_its_budget_and_reads_what_it_says(tmp_path: Path) -> None:
    """A 4 MiB float32 tensor with one NaN in every 64 KiB block and small tensors with
    an Inf each, scanned with a 512 KiB budget: the small ones are read whole (always
    found), the blocks read are exactly the NaNs found, and never more than the budget."""
    big = torch.zeros(1 << 20, dtype=torch.float32)
    per_block = SAMPLE_BLOCK // 4
    big[per_block // 2 :: per_block] = float("nan")
    small = {f"norm{i}": torch.ones(64) for i in range(5)}
    for t in small.values():
        t[3] = float("inf")
    save_file({"big": big, **small}, str(tmp_path / "m.safetensors"))
    from engram_trt.checkpoint.files import _tensor_infos

    regions = [
        Region(n, i.file, i.data_offset, i.nbytes, i.st_dtype)
        for n, i in _tensor_infos(tmp_path / "m.safetensors").items()
    ]
    small_bytes = sum(r.nbytes for r in regions if r.name != "big")
    seen = set()
    for seed in range(6):
        res = scan_regions(regions, budget_bytes=512 << 10, seed=seed)
        assert not res.full and res.bytes_read <= 512 << 10 and res.bytes_total == big.numel() * 4 + small_bytes
        found = {f.name: f for f in res.findings}
        assert all(found[n].inf == 1 and found[n].first == 3 for n in small)
        blocks_read = (res.bytes_read - small_bytes) // SAMPLE_BLOCK
        assert blocks_read >= 4 and found["big"].nan == blocks_read
        seen.add(found["big"].first)
        assert "sampled" in res.cost() and "%" in res.cost()
    assert len(seen) > 1  # each seed draws other blocks
    full = scan_regions(regions, budget_bytes=None)
    assert full.full and {f.name: f.nan for f in full.findings}["big"] == big.numel() // per_block


# ---------------------------------------------------------------- a NaN in each family
def _refused_everywhere(capsys: pytest.CaptureFixture, ck: Path, tmp: Path, tensors: list[str]) -> None:
    """inspect lists every tensor named (exit 1, its scan's cost printed); build refuses
    the first in one line before writing anything."""
    before = tree_digest(ck)
    code, out, _ = _cli(capsys, "inspect", str(ck), "--json")
    rep = json.loads(out)
    assert code == 1
    for name in tensors:
        assert any(name in p and ("NaN" in p or "Inf" in p) for p in rep["problems"]), (name, rep["problems"])
    assert rep["nonfinite"]["full"] and rep["nonfinite"]["bytes_read"] == rep["nonfinite"]["bytes_total"]
    code, out, _ = _cli(capsys, "inspect", str(ck))
    assert code == 1 and "NaN / Inf    in" in out and "read in" in out
    code, _, err = _cli(capsys, "build", str(ck), "-o", str(tmp / "engine"), "--no-engine")
    assert code == 2
    _one_line(err)
    assert any(name in err for name in tensors) and "re-convert" in err, err
    assert not (tmp / "engine").exists() and not [p for p in tmp.iterdir() if p.name.startswith(".")]
    assert tree_digest(ck) == before


class _Stored:
    """A checkpoint's names and stored dtypes, as unread_scale asks them."""

    def __init__(self, dtypes: dict[str, str]) -> None:
        self.dtypes = dtypes

    def __contains__(self, name: object) -> bool:
        return name in self.dtypes

    def st_dtype(self, name: str) -> str:
        return self.dtypes[name]


@pytest.mark.parametrize(
    "stored, scale, unread",
    [
        # transformers' FP8 save: a scale beside a weight it left in 16 bits is never read
        ({"m.q.weight": "BF16", "m.q.weight_scale_inv": "F32"}, "m.q.weight_scale_inv", True),
        ({"m.q.weight": "F8_E4M3", "m.q.weight_scale_inv": "F32"}, "m.q.weight_scale_inv", False),
        # the experts' merged scales: per-expert weights (expert 0 for the layer) or merged ones
        (
            {"l.experts.0.down_proj.weight": "BF16", "l.experts.down_proj_scale_inv": "F32"},
            "l.experts.down_proj_scale_inv",
            True,
        ),
        (
            {"l.experts.0.down_proj.weight": "F8_E4M3", "l.experts.down_proj_scale_inv": "F32"},
            "l.experts.down_proj_scale_inv",
            False,
        ),
        (
            {"l.experts.0.gate_proj.weight": "F8_E4M3", "l.experts.0.up_proj.weight": "F8_E4M3"},
            "l.experts.gate_up_proj_scale_inv",
            False,
        ),
        ({"l.experts.gate_up_proj": "F32"}, "l.experts.gate_up_proj_scale_inv", True),
        # no weight it could scale: kept (a reader would name it), and other names are not scales
        ({}, "l.experts.down_proj_scale_inv", False),
        ({"l.experts.0.down_proj.weight": "BF16"}, "l.experts.0.down_proj.weight", False),
    ],
)
def test_a_scale_beside_a_float_weight_is_not_scanned(stored: dict[str, str], scale: str, unread: bool) -> None:
    """The non-finite scan leaves out the scales no loader reads: transformers writes them
    uninitialized beside the weights it kept in floats, the experts' merged
    ``down_proj_scale_inv`` among them (garbage there is not the model's problem)."""
    from engram_trt.checkpoint.nonfinite import unread_scale

    assert unread_scale(_Stored(stored), scale) is unread


def test_nan_in_a_deepseek_v4_weight(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ck = _copy(DATA / "deepseek_v4_tiny", tmp_path / "ck")

    def edit(d: dict) -> None:
        d["model.layers.1.attn.compressor.wkv.weight"][2, 5] = float("nan")
        d["model.norm.weight"][0] = float("-inf")

    _edit(ck, edit)
    _refused_everywhere(capsys, ck, tmp_path, ["model.layers.1.attn.compressor.wkv.weight", "model.norm.weight"])
    # Served anyway (run reads what it is given): the Inf norm makes the logits non-finite,
    # and the request ends with an error line, never tokens.
    code, out, err = _cli(capsys, "run", str(ck), *GEN)
    assert code == 2 and "logits are NaN or Inf at output token 0" in err and "output:" not in out
    _one_line(err)


def test_nan_in_a_qwen4_exp_ple_shard(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ck = _copy(DATA / "qwen4_exp_tiny", tmp_path / "ck")
    shards = [f"model.layers.0.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in (0, 1)]

    def edit(d: dict) -> None:
        for s in shards:
            d[s][:] = float("nan")

    _edit(ck, edit)
    _refused_everywhere(capsys, ck, tmp_path, shards)
    code, out, err = _cli(capsys, "run", str(ck), *GEN)
    assert code == 2 and "logits are NaN or Inf" in err
    _one_line(err)


def test_nan_in_an_engram_llama_table(tmp_path: Path, tiny_ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    """The FP8 table's NaN byte (0x7f) and its E8M0 scale's (0xff)."""
    ck = _copy(tiny_ckpt, tmp_path / "ck")
    shard = next(ck.glob("model*.safetensors")).name
    table, scale = "model.layers.1.engram.embed.weight", "model.layers.1.engram.embed.weight_scale_inv"

    def edit(d: dict) -> None:
        d[table].view(torch.uint8)[100, 3] = 0x7F
        d[scale].view(torch.uint8)[7, 0] = 0xFF

    _edit(ck, edit, shard)
    _refused_everywhere(capsys, ck, tmp_path, [table, scale])


def test_nan_in_a_gguf_norm_is_refused_by_import_gguf(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
    from gguf import GGMLQuantizationType as GGML
    from helpers.gguf_files import write_tiny_gguf

    norm = np.ones(64, dtype=np.float32)
    norm[9] = np.nan
    try:
        write_tiny_gguf(tmp_path / "nan.gguf", raw_tensors={"blk.1.ffn_norm.weight": (norm, GGML.F32)})
    except ValueError as exc:  # the writer's own shape rules: the tiny model's width
        pytest.fail(f"tiny GGUF: {exc}")
    code, _, err = _cli(capsys, "import-gguf", str(tmp_path / "nan.gguf"), str(tmp_path / "out"))
    assert code == 2
    _one_line(err)
    assert "blk.1.ffn_norm.weight" in err and "model.layers.1.post_attention_layernorm.weight" in err and "1 NaN" in err
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- at run time
def test_sample_flags_every_non_finite_row_and_draws_only_from_finite_ones() -> None:
    """Scheduler._sample over a step's logits with NaN and Inf rows, greedy and seeded
    rows mixed: each row's flag is its finiteness (torch.isfinite), finite greedy rows
    take the argmax, finite sampled rows the token their own generator draws, and a
    non-finite row never reaches the sampler (softmax of NaN would raise)."""
    from engram_trt.models.sampling import sample_next
    from engram_trt.runtime.sampling_params import SamplingParams
    from engram_trt.runtime.scheduler import Request, Scheduler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[1, 7] = float("nan")
    logits[3, 0] = float("inf")
    logits[4, 11] = float("-inf")
    want_finite = torch.isfinite(logits).all(dim=-1).tolist()

    def req(greedy: bool, seed: int) -> Request:
        p = SamplingParams(max_tokens=4, temperature=0.0 if greedy else 0.7, top_p=0.9, seed=seed)
        r = Request(f"r{seed}", None, [1], p, None)
        if not greedy:
            r.generator = torch.Generator().manual_seed(seed)
        return r

    # all greedy, every row: the one-read path
    reqs = [req(True, i) for i in range(6)]
    picks, finite = Scheduler._sample(None, logits, reqs, list(range(6)))  # type: ignore[arg-type]
    assert finite == want_finite
    assert [p for p, f in zip(picks, finite) if f] == [int(torch.argmax(logits[i])) for i in range(6) if want_finite[i]]
    # mixed, a subset of rows
    rows = [0, 1, 2, 3, 5]
    reqs = [req(k % 2 == 0, 10 + k) for k in range(len(rows))]
    picks, finite = Scheduler._sample(None, logits, reqs, rows)  # type: ignore[arg-type]
    assert finite == [want_finite[r] for r in rows]
    for k, r in enumerate(rows):
        if not finite[k]:
            continue
        if reqs[k].params.greedy:
            assert picks[k] == int(torch.argmax(logits[r]))
        else:
            ref = sample_next(logits[r], 0.7, 0.9, torch.Generator().manual_seed(10 + k))
            assert picks[k] == ref


def test_a_request_with_nan_logits_ends_with_an_error_and_the_others_go_on(tmp_path: Path) -> None:
    """DeepSeek-V4 with a NaN embedding row (token 17): the requests whose prompt holds it
    end with finish_reason 'error' and one line; the others, in the same batch, give the
    clean folder's tokens (greedy and seeded)."""
    from engram_trt import LLM, SamplingParams

    ck = _copy(DATA / "deepseek_v4_tiny", tmp_path / "ck")
    _edit(ck, lambda d: d["model.embed_tokens.weight"][17].fill_(float("nan")))
    prompts = [[5, 6, 7], [5, 17, 7], [9, 10], [17], [11, 12, 13, 14]]
    params = [
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.8, seed=6, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    ]
    with LLM(str(DATA / "deepseek_v4_tiny"), backend="torch", device="cpu", dtype="fp32") as clean:
        want = [o.token_ids for o in clean.generate(prompts, params)]
    with LLM(str(ck), backend="torch", device="cpu", dtype="fp32") as llm:
        got = llm.generate(prompts, params)
        again = llm.generate([[5, 6, 7]], params[0])  # the server still serves
    for i, o in enumerate(got):
        if 17 in prompts[i]:
            assert o.finish_reason == "error" and o.token_ids == [], (i, o)
            assert o.error is not None and "\n" not in o.error and "logits are NaN or Inf" in o.error
        else:
            assert o.error is None and o.finish_reason == "length" and o.token_ids == want[i], (i, o)
    assert again[0].token_ids == want[0]


def test_prompts_file_lists_each_failed_prompt_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ck = _copy(DATA / "deepseek_v4_tiny", tmp_path / "ck")
    _edit(ck, lambda d: d["model.embed_tokens.weight"][17].fill_(float("nan")))
    f = tmp_path / "prompts.txt"
    f.write_text("w5 w6\nw5 w17\n")
    code, out, _ = _cli(
        capsys, "run", str(ck), "--prompts-file", str(f), "--max-new-tokens", "2", "--device", "cpu", "--json"
    )
    res = json.loads(out)["results"]
    assert code == 1
    assert res[0]["error"] is None and len(res[0]["token_ids"]) == 2
    assert res[1]["finish_reason"] == "error" and "logits are NaN or Inf" in res[1]["error"]
    assert res[1]["token_ids"] == []


# ---------------------------------------------------------------- the tokenizer
def test_build_refuses_a_missing_or_broken_tokenizer_unless_token_ids_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ck = _copy(DATA / "deepseek_v4_tiny", tmp_path / "ck")
    tok = (ck / "tokenizer.json").read_bytes()
    (ck / "tokenizer.json").write_bytes(tok[:300])  # truncated
    code, out, _ = _cli(capsys, "inspect", str(ck), "--json")
    assert code == 1 and any("not a readable tokenizer.json" in p for p in json.loads(out)["problems"])
    for extra in ([], ["--token-ids-only"]):  # a broken one is refused either way
        code, _, err = _cli(capsys, "build", str(ck), "-o", str(tmp_path / "e"), "--no-engine", *extra)
        assert code == 2 and "tokenizer.json" in err and "not a readable tokenizer.json" in err
        _one_line(err)
    (ck / "tokenizer.json").unlink()
    code, out, _ = _cli(capsys, "inspect", str(ck), "--json")
    assert code == 1 and any("no tokenizer.json" in p and "--token-ids-only" in p for p in json.loads(out)["problems"])
    code, out, _ = _cli(capsys, "inspect", str(ck), "--json", "--token-ids-only")
    assert code == 0 and json.loads(out)["problems"] == []
    code, _, err = _cli(capsys, "build", str(ck), "-o", str(tmp_path / "e"), "--no-engine")
    assert code == 2 and "has no tokenizer.json" in err and "--token-ids-only" in err
    _one_line(err)
    assert not (tmp_path / "e").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # --token-ids-only: built, recorded, served token ids; text refused in one line
    code, _, err = _cli(
        capsys, "build", str(ck), "-o", str(tmp_path / "e"), "--no-engine", "--max-batch", "2", "--token-ids-only"
    )
    assert code == 0, err
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["token_ids_only"] is True and m["tokenizer"] is None
    code, _, err = _cli(capsys, "run", str(tmp_path / "e"), *GEN)
    assert code == 2 and "--token-ids-only" in err and "send token ids" in err
    _one_line(err)
    from engram_trt import LLM, SamplingParams

    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path / "e"), backend="torch", device="cpu", dtype="fp32") as llm:
        got = llm.generate([[5, 6, 7]], sp)[0]
    with LLM(str(DATA / "deepseek_v4_tiny"), backend="torch", device="cpu", dtype="fp32") as ref:
        want = ref.generate([[5, 6, 7]], sp)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 3 and got.text == ""


def test_an_engram_model_needs_its_tokenizer_even_with_token_ids_only(
    tmp_path: Path, tiny_ckpt: Path, capsys: pytest.CaptureFixture
) -> None:
    ck = _copy(tiny_ckpt, tmp_path / "ck")
    (ck / "tokenizer.json").unlink()
    code, _, err = _cli(capsys, "build", str(ck), "-o", str(tmp_path / "e"), "--no-engine", "--token-ids-only")
    assert code == 2 and "Engram needs for the compressed vocab" in err
    _one_line(err)
