"""Bad inputs a careless or hostile user gives the newer paths: DeepSeek-V4 and Qwen4Exp
folders through run, inspect, build, serve, triton-repo, bench and layout / hash,
``--chat``, ``--prompts-file``, ``--tp`` / ``--dp``, ``import-gguf``, and outputs that are
links, mount-point-like or someone else's lock. Each case: exit 2, exactly one
``engram-trt: error:`` line naming the input (and the fix where one is named), no
traceback, and every file the case points at byte for byte as before (sha256 of each
file, links by target), with no new entry beside them.

In-process CLI calls (``main``), as tests/cli/test_bad_inputs.py does for the older paths;
the workspace is made once per module and each case's inputs on first use.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.files import REPO, file_sha256, tree_digest
from engram_trt.cli.main import main

DATA = REPO / "tests" / "data"
DS, QW = DATA / "deepseek_v4_tiny", DATA / "qwen4_exp_tiny"
PLE0 = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"
PLE1 = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"
RUN = ["--max-new-tokens", "2", "--device", "cpu"]


# ---------------------------------------------------------------- the workspace
def _copy(ws: Path, src: Path, name: str) -> Path:
    dst = ws / name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _config_edit(src: Path, **patch: Any) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        ck = _copy(ws, src, name)
        cfg = json.loads((ck / "config.json").read_text())
        for k, v in patch.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (ck / "config.json").write_text(json.dumps(cfg))
        return str(ck)

    return make


def _tensor_edit(src: Path, edit: Callable[[dict], None]) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        ck = _copy(ws, src, name)
        d = load_file(str(ck / "model.safetensors"))
        edit(d)
        save_file(d, str(ck / "model.safetensors"), metadata={"format": "pt"})
        return str(ck)

    return make


def _file_edit(src: Path, fname: str, edit: Callable[[Path], None]) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        ck = _copy(ws, src, name)
        edit(ck / fname)
        return str(ck)

    return make


def _write(text: bytes | str) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        p = ws / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)

    return make


def _dir(files: dict[str, str]) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        d = ws / name
        d.mkdir()
        for f, t in files.items():
            (d / f).write_text(t)
        return str(d)

    return make


def _link(to: str) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        (ws / name).symlink_to(ws / to)
        return str(ws / name)

    return make


def _with_user_lock(out_name: str, content: str) -> Callable[[Path, str], str]:
    """A folder OUT to write, beside which the user keeps a file named like our lock."""

    def make(ws: Path, name: str) -> str:
        d = ws / name
        d.mkdir()
        (d / f".{out_name}.engram-trt.lock").write_text(content)
        return str(d / out_name)

    return make


def _tiny_gguf(raw: dict | None = None) -> Callable[[Path, str], str]:
    def make(ws: Path, name: str) -> str:
        pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
        from helpers.gguf_files import write_tiny_gguf

        write_tiny_gguf(ws / name, raw_tensors=raw)
        return str(ws / name)

    return make


def _nan_norm() -> dict:
    import numpy as np
    from gguf import GGMLQuantizationType as GGML

    v = np.ones(64, dtype=np.float32)
    v[0] = np.inf
    return {"output_norm.weight": (v, GGML.F32)}


def _nan_gguf(ws: Path, name: str) -> str:
    pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
    return _tiny_gguf(_nan_norm())(ws, name)


def _set(name: str, index: Any, value: Any) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d[name][index] = value

    return edit


def _drop(name: str) -> Callable[[dict], None]:
    return lambda d: d.pop(name)


def _put(name: str, tensor: torch.Tensor) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d[name] = tensor

    return edit


def _cast(name: str, dtype: torch.dtype) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d[name] = d[name].to(dtype)

    return edit


def _truncate(n: int) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(p.read_bytes()[:n])


SETUP: dict[str, Callable[[Path, str], str]] = {
    "ds": lambda ws, name: str(_copy(ws, DS, name)),
    "qw": lambda ws, name: str(_copy(ws, QW, name)),
    "ds_gelu": _config_edit(DS, hidden_act="gelu"),
    "ds_kv2": _config_edit(DS, num_key_value_heads=2),
    "ds_types_short": _config_edit(DS, layer_types=["heavily_compressed_attention"]),
    "ds_type_bogus": _config_edit(
        DS, layer_types=["heavily_compressed_attention", "bogus_attention", "heavily_compressed_attention"]
    ),
    "ds_experts8": _config_edit(DS, n_routed_experts=8),
    "ds_model_type_llama": _config_edit(DS, model_type="llama"),
    "ds_arch_unknown": _config_edit(DS, architectures=["FooForCausalLM"], model_type=None),
    "ds_positions_huge": _config_edit(DS, max_position_embeddings=10**15),
    "ds_no_norm": _tensor_edit(DS, _drop("model.norm.weight")),
    "ds_norm_short": _tensor_edit(DS, _put("model.norm.weight", torch.ones(31))),
    "ds_tid2eid_99": _tensor_edit(DS, _set("model.layers.0.ffn.gate.tid2eid", 0, 99)),
    "ds_tid2eid_float": _tensor_edit(DS, _cast("model.layers.0.ffn.gate.tid2eid", torch.float32)),
    "ds_extra_tensor": _tensor_edit(DS, _put("extra.weight", torch.ones(3))),
    "ds_nan": _tensor_edit(DS, _set("model.layers.2.attn.wq_a.weight", (0, 0), float("nan"))),
    "ds_no_tokenizer": _file_edit(DS, "tokenizer.json", lambda p: p.unlink()),
    "ds_tokenizer_cut": _file_edit(DS, "tokenizer.json", _truncate(200)),
    "ds_shard_cut": _file_edit(DS, "model.safetensors", _truncate(5000)),
    "ds_config_utf16": _file_edit(DS, "config.json", lambda p: p.write_bytes(p.read_text().encode("utf-16"))),
    "qw_types_bogus": _config_edit(
        QW, layer_types=["linear_attention", "bogus", "linear_attention", "indexed_attention"]
    ),
    "qw_no_shard1": _tensor_edit(QW, _drop(PLE1)),
    "qw_shard0_rows": _tensor_edit(QW, _put(PLE0, torch.zeros(100, 4))),
    "qw_shard_f64": _tensor_edit(QW, lambda d: d.update({PLE0: d[PLE0].double(), PLE1: d[PLE1].double()})),
    "qw_shard_mixed": _tensor_edit(QW, _cast(PLE0, torch.float16)),
    "qw_multipliers": _tensor_edit(QW, _set("model.layers.0.ple.ple_embedding.layer_multipliers", 0, 12345)),
    "qw_nan_ple": _tensor_edit(QW, _set(PLE1, (5, 2), float("nan"))),
    "qw_extra_tensor": _tensor_edit(QW, _put("model.visual.patch_embed.weight", torch.ones(2))),
    "qw_no_tokenizer": _file_edit(QW, "tokenizer.json", lambda p: p.unlink()),
    "prompts": _write("w1 w2\nw3\n"),
    "prompts_bad_utf8": _write(b"w1 \xff\xfe\n"),
    "prompts_empty": _write("\n  \n"),
    "prompts_json_ints": _write("[1, 2]"),
    "prompts_json_broken": _write('["w1", '),
    "folder": _dir({"notes.txt": "the user's\n"}),
    "foreign": _dir({"notes.txt": "someone's repository\n"}),
    "plain_file": _write("just a file\n"),
    "under_file": lambda ws, name: str(Path(SETUP_MADE.get("plain_file") or _write("x")(ws, "plain_file")) / "sub"),
    "dangling": _link("nowhere-at-all"),
    "user_lock": _with_user_lock("out", "the user's notes\n"),
    "gguf": _tiny_gguf(),
    "gguf_nan": _nan_gguf,
    "not_gguf": _write(b"GGUF" + b"\x00" * 20),
    "new": lambda ws, name: str(ws / "never-made"),
}
SETUP_MADE: dict[str, str] = {}

# fmt: off
CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    # -- DeepSeek-V4: configs and checkpoints run / inspect / build refuse
    ("ds-hidden-act-gelu", ["run", "{ds_gelu}", *RUN], ("hidden_act", "gelu", "not implemented")),
    ("ds-two-kv-heads", ["build", "{ds_kv2}", "-o", "{new}"], ("num_key_value_heads",)),
    ("ds-layer-types-short", ["run", "{ds_types_short}", *RUN], ("layer_types",)),
    ("ds-layer-type-bogus", ["inspect", "{ds_type_bogus}"], ("bogus_attention",)),
    ("ds-experts-8-of-4", ["run", "{ds_experts8}", *RUN], ("expert",)),
    ("ds-model-type-llama", ["run", "{ds_model_type_llama}", *RUN], ("model_type 'llama'", "another model family")),
    ("ds-architecture-unknown", ["build", "{ds_arch_unknown}", "-o", "{new}"],
     ("FooForCausalLM", "supported architectures")),
    ("ds-positions-1e15", ["inspect", "{ds_positions_huge}"], ("max_position_embeddings", "out of range")),
    ("ds-missing-norm", ["run", "{ds_no_norm}", *RUN], ("model.norm.weight", "missing")),
    ("ds-norm-misshapen", ["build", "{ds_norm_short}", "-o", "{new}"], ("model.norm.weight", "[31]")),
    ("ds-tid2eid-out-of-range", ["run", "{ds_tid2eid_99}", *RUN], ("tid2eid", "expert 99")),
    ("ds-tid2eid-float", ["build", "{ds_tid2eid_float}", "-o", "{new}"], ("tid2eid", "F32")),
    ("ds-unused-tensor", ["run", "{ds_extra_tensor}", *RUN], ("extra.weight", "--allow-unused-weights")),
    ("ds-nan-build", ["build", "{ds_nan}", "-o", "{new}"], ("model.layers.2.attn.wq_a.weight", "NaN")),
    ("ds-no-tokenizer-build", ["build", "{ds_no_tokenizer}", "-o", "{new}"], ("tokenizer.json", "--token-ids-only")),
    ("ds-truncated-tokenizer-build", ["build", "{ds_tokenizer_cut}", "-o", "{new}"],
     ("tokenizer.json", "not a readable")),
    ("ds-truncated-tokenizer-run", ["run", "{ds_tokenizer_cut}", *RUN], ("tokenizer.json", "not a readable")),
    ("ds-truncated-shard", ["inspect", "{ds_shard_cut}"], ("model.safetensors",)),
    ("ds-config-utf16", ["run", "{ds_config_utf16}", *RUN], ("config.json", "UTF-8")),
    ("ds-max-new-tokens-past-positions", ["run", "{ds}", "--max-new-tokens", "300"],
     ("--max-new-tokens 300", "max_position_embeddings=256")),
    ("ds-dtype-fp16", ["run", "{ds}", "--dtype", "fp16"], ("--dtype fp16", "fp32 or bf16")),
    ("ds-engram-config-without-tables", ["run", "{ds}", "--engram-config.cpu_offload", "false", *RUN],
     ("--engram-config", "no Engram layers")),
    ("ds-repack-tables", ["build", "{ds}", "-o", "{new}", "--repack-tables", "{folder}"],
     ("--repack-tables", "no Engram layers")),
    ("ds-layout", ["layout", "{ds}"], ("DeepSeek-V4 model has no Engram layers", "engram-trt inspect")),
    ("ds-hash", ["hash", "{ds}", "--ids", "1,2"], ("DeepSeek-V4 model has no Engram layers",)),
    # -- DeepSeek-V4: several ranks, chat, prompts files
    ("ds-tp-3", ["run", "{ds}", "--tp", "3", *RUN],
     ("--tp 3", "DeepSeek-V4's num_attention_heads=4 do not divide over 3 ranks", "2, 4")),
    ("ds-tp-4-dp-2", ["run", "{ds}", "--tp", "4", "--dp", "2", *RUN], ("--tp 4", "DeepSeek-V4")),
    ("ds-tp-0", ["run", "{ds}", "--tp", "0", *RUN], ("--tp must be >= 1",)),
    ("ds-dp-2-engram-config", ["run", "{ds}", "--dp", "2", "--engram-config.embedding_across_dp", "true", *RUN],
     ("embedding_across_dp", "no Engram layers")),
    ("ds-chat-without-template", ["run", "{ds}", "--chat", *RUN], ("chat template", "tokenizer_config.json")),
    ("ds-chat-with-tp", ["run", "{ds}", "--chat", "--tp", "2", *RUN], ("--chat", "--tp")),
    ("ds-chat-with-prompts-file", ["run", "{ds}", "--chat", "--prompts-file", "{prompts}", *RUN],
     ("--chat", "--prompts-file")),
    ("ds-system-without-chat", ["run", "{ds}", "--system", "be brief", *RUN], ("--system", "--chat")),
    ("ds-system-not-utf8", ["run", "{ds}", "--chat", "--system", "caf\udce9", *RUN], ("--system", "not UTF-8")),
    ("ds-prompts-file-is-a-folder", ["run", "{ds}", "--prompts-file", "{folder}", *RUN],
     ("--prompts-file", "is a folder, not a file")),
    ("ds-prompts-file-missing", ["run", "{ds}", "--prompts-file", "{new}", *RUN], ("--prompts-file", "no such file")),
    ("ds-prompts-file-not-utf8", ["run", "{ds}", "--prompts-file", "{prompts_bad_utf8}", *RUN],
     ("--prompts-file", "not UTF-8")),
    ("ds-prompts-file-empty", ["run", "{ds}", "--prompts-file", "{prompts_empty}", *RUN],
     ("--prompts-file", "holds no prompt")),
    ("ds-prompts-file-json-ints", ["run", "{ds}", "--prompts-file", "{prompts_json_ints}", *RUN],
     ("--prompts-file", "list of non-empty strings")),
    ("ds-prompts-file-json-broken", ["run", "{ds}", "--prompts-file", "{prompts_json_broken}", *RUN],
     ("--prompts-file", "not valid JSON")),
    ("ds-stop-not-utf8", ["run", "{ds}", "--stop", "\udcff", *RUN], ("--stop", "not UTF-8")),
    ("ds-stop-empty", ["run", "{ds}", "--stop", "", *RUN], ("--stop is empty",)),
    # -- DeepSeek-V4: outputs that are not a new folder of ours
    ("ds-build-into-the-checkpoint", ["build", "{ds}", "-o", "{ds}/engine"], ("inside the checkpoint folder",)),
    ("ds-build-into-a-foreign-folder", ["build", "{ds}", "-o", "{foreign}"], ("did not write", "--force")),
    ("ds-build-into-a-dangling-link", ["build", "{ds}", "-o", "{dangling}"],
     ("is a symbolic link to", "does not exist")),
    ("ds-build-beside-a-users-lock-name", ["build", "{ds}", "-o", "{user_lock}"],
     (".out.engram-trt.lock", "is not an engram-trt lock", "move it away")),
    ("ds-build-under-a-file", ["build", "{ds}", "-o", "{under_file}"], ("is a file, not a folder",)),
    # -- serve / triton-repo / bench
    ("ds-serve-tp-3", ["serve", "{ds}", "--tp", "3", "--device", "cpu"],
     ("--tp 3", "DeepSeek-V4's num_attention_heads=4")),
    ("ds-serve-repo-foreign", ["serve", "{ds}", "--repo", "{foreign}", "--device", "cpu"], ("--repo", "is not empty")),
    ("ds-serve-repo-dangling", ["serve", "{ds}", "--repo", "{dangling}", "--device", "cpu"],
     ("--repo", "symbolic link")),
    ("ds-serve-address-999", ["serve", "{ds}", "--address", "999.1.1.1", "--device", "cpu"],
     ("--address '999.1.1.1'", "0.0.0.0")),
    ("ds-serve-address-not-here", ["serve", "{ds}", "--address", "10.255.255.1", "--device", "cpu"],
     ("--address '10.255.255.1'", "cannot listen there")),
    ("ds-serve-port-70000", ["serve", "{ds}", "--http-port", "70000", "--device", "cpu"],
     ("--http-port 70000", "0..65535")),
    ("ds-serve-instances-and-dp", ["serve", "{ds}", "--instances", "2", "--dp", "2", "--device", "cpu"],
     ("--instances 2", "--dp 2")),
    ("ds-serve-ready-timeout-0", ["serve", "{ds}", "--ready-timeout", "0", "--device", "cpu"], ("--ready-timeout",)),
    ("ds-triton-repo-tp-8", ["triton-repo", "{ds}", "--out", "{new}", "--tp", "8", "--device", "cpu"],
     ("--tp 8", "DeepSeek-V4")),
    ("ds-triton-repo-dp-2-across", ["triton-repo", "{ds}", "--out", "{new}", "--dp", "2", "--device", "cpu",
      "--engram-config.embedding_across_dp", "true"],
     ("embedding_across_dp",)),
    ("ds-bench-serve-concurrency-text", ["bench", "serve", "{ds}", "--concurrency", "a,b"],
     ("--concurrency", "positive integers")),
    ("ds-bench-serve-device-meta", ["bench", "serve", "{ds}", "--device", "meta", "--concurrency", "1"],
     ("device 'meta'", "cpu and cuda")),
    ("ds-demo-checkpoint-into-it", ["demo-checkpoint", "{ds}"], ("is not empty", "--force")),
    # -- Qwen4Exp
    ("qw-layer-type-bogus", ["run", "{qw_types_bogus}", *RUN], ("layer_types", "bogus")),
    ("qw-missing-ple-shard", ["run", "{qw_no_shard1}", *RUN], (PLE1,)),
    ("qw-ple-shard-rows", ["build", "{qw_shard0_rows}", "-o", "{new}"],
     ("PLE table of layer 1", "the table and the config disagree")),
    ("qw-ple-shards-f64", ["build", "{qw_shard_f64}", "-o", "{new}"], ("F64", "EngramGather")),
    ("qw-ple-shards-mixed", ["build", "{qw_shard_mixed}", "-o", "{new}"], ("mix dtypes",)),
    ("qw-ple-multipliers", ["run", "{qw_multipliers}", *RUN], ("layer_multipliers",)),
    ("qw-nan-in-ple-build", ["build", "{qw_nan_ple}", "-o", "{new}"], (PLE1, "NaN")),
    ("qw-unused-vision-tensor", ["build", "{qw_extra_tensor}", "-o", "{new}"],
     ("model.visual.patch_embed.weight", "--allow-unused-weights")),
    ("qw-no-tokenizer-build", ["build", "{qw_no_tokenizer}", "-o", "{new}"], ("tokenizer.json", "--token-ids-only")),
    ("qw-no-tokenizer-run", ["run", "{qw_no_tokenizer}", *RUN], ("tokenizer.json",)),
    ("qw-tp-4", ["run", "{qw}", "--tp", "4", *RUN],
     ("--tp 4", "Qwen4Exp's num_attention_heads=2 do not divide over 4 ranks")),
    ("qw-embedding-across-dp", ["run", "{qw}", "--dp", "2", "--engram-config.embedding_across_dp", "true", *RUN],
     ("embedding_across_dp", "Qwen4Exp's own tables (not Engram tables) are not sharded", "dp_shared_memory")),
    ("qw-hot-cache-with-gpu-tables", ["run", "{qw}", "--engram-config.cpu_offload", "false",
      "--engram-config.hot_cache_fraction", "0.5", *RUN],
     ("hot_cache_fraction", "cpu_offload")),
    ("qw-serve-tp-4", ["serve", "{qw}", "--tp", "4", "--device", "cpu"], ("--tp 4", "Qwen4Exp")),
    ("qw-layout", ["layout", "{qw}"], ("Qwen4Exp model has no Engram layers",)),
    ("qw-max-new-tokens-past-positions", ["run", "{qw}", "--max-new-tokens", "100000"], ("--max-new-tokens 100000",)),
    ("qw-chat-with-dp", ["run", "{qw}", "--chat", "--dp", "2", *RUN], ("--chat",)),
    ("qw-build-output-is-the-checkpoint", ["build", "{qw}", "-o", "{qw}"], ("inside the checkpoint folder",)),
    ("qw-inspect-a-file", ["inspect", "{plain_file}"], ("is a file, not a checkpoint folder",)),
    # -- import-gguf
    ("gguf-a-folder", ["import-gguf", "{qw}", "{new}"], ("GGUF",)),
    ("gguf-not-gguf", ["import-gguf", "{not_gguf}", "{new}"], ("not_gguf",)),
    ("gguf-missing", ["import-gguf", "{folder}/missing.gguf", "{new}"], ("missing.gguf",)),
    ("gguf-out-not-empty", ["import-gguf", "{gguf}", "{folder}"], ("is not empty", "--force")),
    ("gguf-out-is-a-file", ["import-gguf", "{gguf}", "{plain_file}"], ("not a folder",)),
    ("gguf-out-dangling-link", ["import-gguf", "{gguf}", "{dangling}"], ("symbolic link", "does not exist")),
    ("gguf-out-beside-a-users-lock-name", ["import-gguf", "{gguf}", "{user_lock}"], ("is not an engram-trt lock",)),
    ("gguf-inf-norm", ["import-gguf", "{gguf_nan}", "{new}"], ("output_norm.weight", "model.norm.weight", "Inf")),
    ("gguf-shard-size-10", ["import-gguf", "{gguf}", "{new}", "--max-shard-size", "10"],
     ("--max-shard-size", "below 1 MiB")),
    ("gguf-dtype-int8", ["import-gguf", "{gguf}", "{new}", "--dtype", "int8"], ("--dtype", "int8")),
]
# fmt: on


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    commands = {c[1][0] for c in CASES} | {c[1][1] for c in CASES if c[1][0] == "bench"}
    assert commands >= {"run", "inspect", "build", "serve", "triton-repo", "import-gguf", "layout", "hash", "serve"}
    flags = {a for c in CASES for a in c[1]}
    assert flags >= {"--chat", "--prompts-file", "--tp", "--dp", "--stop"}
    assert sum(c[0].startswith("ds-") for c in CASES) >= 25 and sum(c[0].startswith("qw-") for c in CASES) >= 15


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hidden-cases")


def _fill(argv: list[str], ws: Path) -> tuple[list[str], list[str]]:
    out, used = [], []
    for a in argv:
        for key in SETUP:
            token = "{" + key + "}"
            if token in a:
                if key not in SETUP_MADE:
                    SETUP_MADE[key] = SETUP[key](ws, key)
                a = a.replace(token, SETUP_MADE[key])
                used.append(SETUP_MADE[key])
        out.append(a)
    return out, used


def _state(paths: list[str], ws: Path) -> dict[str, Any]:
    """Every file the case points at (sha256; a folder's whole tree; a link's target) and
    the names in the workspace and beside each path (a new temporary, lock or output shows)."""
    st: dict[str, Any] = {"ws": sorted(p.name for p in ws.iterdir())}
    for p in map(Path, paths):
        if p.is_symlink():
            st[str(p)] = "link:" + os.readlink(p)
        elif p.is_dir():
            st[str(p)] = tree_digest(p)
        elif p.is_file():
            st[str(p)] = file_sha256(p)
        else:
            st[str(p)] = None
        if p.parent.is_dir():
            st[str(p.parent) + "/"] = sorted(x.name for x in p.parent.iterdir())
    return st


@pytest.mark.parametrize("case_id, argv, needles", CASES, ids=[c[0] for c in CASES])
def test_hidden_case(
    case_id: str,
    argv: list[str],
    needles: tuple[str, ...],
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(cache))
    monkeypatch.setenv("ENGRAM_TRT_NO_PROGRESS", "1")
    args, used = _fill(argv, workspace)
    before = _state(used, workspace)
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own exit: still 2 and one line
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (case_id, code, out[-300:], err[-1500:])
    assert err.startswith("engram-trt: error: ") and err.count("\n") == 1, (case_id, err)
    assert "Traceback" not in err and "failed unexpectedly" not in err and len(err) < 2500, (case_id, err)
    for needle in needles:
        assert needle in err, (case_id, needle, err)
    assert _state(used, workspace) == before, f"{case_id}: a file changed or appeared"
    assert not (workspace / "never-made").exists(), f"{case_id}: an output was created"
    assert not any(cache.iterdir()), f"{case_id}: the cache was written"
