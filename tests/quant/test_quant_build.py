"""``engram-trt build`` of checkpoints stored FP8 / FP4 (issue 40 items 3 and 5), the
weights in their stored bytes, for the three architectures.

The folders are the ones the FP8 / FP4 serving tests use: transformers 5.25's own FP8 save
of tiny random engram-llama and Qwen4Exp models (tests/helpers/checkpoints.py: transformers_fp8_save),
one laid out by the formats note with partial blocks (dims 320 / 200: not multiples of
128), and DeepSeek-V4 / V4.1 laid out as the hub ships V4.1-Flash (FP8 linears with ue8m0
128 x 128 scales, FP4 routed experts, DeepSeek's root names; one under transformers'
names, one with FP8 routed experts, ``expert_dtype: "fp8"``), partial blocks included.

* The exported graph (fp32), run by ONNX's ReferenceEvaluator over a packed prefill of
  three prompts (slots out of order) and two decode steps, equals the reference within
  1e-4 relative: transformers loading the folder (its CPU load dequantizes) or, where it
  cannot (partial blocks, merged expert scales), the folder dequantized exactly per the
  format; for V4.1 (not a transformers model) our CPU path on the quantized folder. The
  FP8 DequantizeLinear nodes compute the dequantized product exactly; the
  EngramRoutedExperts nodes run models/reference_ops.py's float64 reference.
* The graph holds every FP8 weight as a FLOAT8E4M3FN initializer under a
  DequantizeLinear (none as a float initializer), FP4 / FP8 routed experts as INT8
  initializers of one EngramRoutedExperts node per MoE layer (Qwen4Exp experts with a
  projection left float take the dense form, dequantized in the graph).
* TensorRT-RTX builds each on the CPU, for the FP8 targets (sm89, sm120, sm121) unless
  --target names them, with the new plugin's layers; an FP8 engine is about the
  checkpoint's bytes: against the engine of the same model dequantized to bf16, it is
  smaller by about the FP8 weights' bytes (one byte a value instead of two), where a
  dequantized-at-build engine would be no smaller.
* The engine folders, through ``LLM``, ``engram-trt run`` and ``engram-trt serve`` (the
  torch backend over the source checkpoint where no TensorRT runtime runs: no GPU here),
  give the reference's greedy tokens.
* Refused in one line, exit 2, nothing written: ``--target`` with sm75 / sm80 / sm86 for an
  FP8 checkpoint; FP4 experts whose dims the plugin cannot take.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import (  # noqa: E402
    dequantized_folder,
    llm_greedy,
    transformers_fp8_save,
    transformers_greedy,
    without_stale_scales,
    word_tokenizer,
)
from helpers.cli import run_json  # noqa: E402
from helpers.plugins import engine_skip_reason  # noqa: E402
from helpers.serving import assert_served_tokens, require_tritonserver, start_serve, stop_serve  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402

EXTRA = [[7, 8], [9, 2], [2, 12]]  # the two decode steps' tokens of each prompt
MAX_LEN = 64
NEW_TOKENS = 6
FP8_TARGETS = ["sm89", "sm120", "sm121"]
ROUTED = "EngramRoutedExperts"


# ------------------------------------------------------------------------------ folders
class Made:
    """One quantized folder: ``folder``, the reference's full-sequence fp32 logits
    (``logits(ids) -> [L, V]`` float64) and greedy tokens (``greedy(prompts)``), the prompts."""

    def __init__(
        self,
        folder: Path,
        logits: Callable[[list[int]], np.ndarray],
        greedy: Callable[[list[list[int]]], list[list[int]]],
        prompts: list[list[int]],
    ) -> None:
        self.folder, self.logits, self.greedy, self.prompts = folder, logits, greedy, prompts


def _hf(model: Any) -> tuple[Callable, Callable]:
    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()

    return logits, lambda prompts: [transformers_greedy(model, p, NEW_TOKENS) for p in prompts]


def llama(name: str, root: Path) -> Made:
    import helpers.llama_fp8 as t
    from transformers import LlamaConfig, LlamaForCausalLM

    overrides, fp8 = t.CASES[name]
    torch.manual_seed(len(name))
    LlamaForCausalLM(LlamaConfig(**dict(t.BASE, **overrides))).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", t.VOCAB)
    if fp8 is None:
        folder = t.partial_block_folder(root / "float", root / "fp8")
        ref = dequantized_folder(folder, root / "ref")
    else:
        folder = transformers_fp8_save(LlamaForCausalLM, root / "float", root / "fp8", **fp8)
        ref = without_stale_scales(folder, root / "ref")
    model = LlamaForCausalLM.from_pretrained(ref, dtype=torch.float32, use_kernels=False).eval()
    return Made(folder, *_hf(model), t.PROMPTS)


def qwen4(name: str, root: Path) -> Made:
    import helpers.qwen4_exp_fp8 as t
    from helpers.qwen4_exp import randomized
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    overrides, fp8 = t.CASES[name]
    kw = dict(t.BASE, **overrides)
    torch.manual_seed(len(name))
    randomized(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**kw)).eval(), len(name)).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", t.VOCAB)
    folder = transformers_fp8_save(Qwen4ExpForCausalLM, root / "float", root / "fp8", **fp8)
    ref = dequantized_folder(folder, root / "ref", moe_intermediate=kw["moe_intermediate_size"])
    model = Qwen4ExpForCausalLM.from_pretrained(ref, dtype=torch.float32, use_kernels=False).eval()
    return Made(folder, *_hf(model), t.PROMPTS)


# name -> (DeepseekV4Config overrides over tests/helpers/deepseek_v4.py's BASE, V4.1, hub names).
# Eight indexer heads: no two compressed entries tie at a top-k cut (test_deepseek_v4_build).
DS_CASES: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # every FP8 dim under 128 (one partial block each), FP4 experts 32 x 32, root names + .scale
    "hub-small": (dict(moe_intermediate_size=32, index_n_heads=8), False, True),
    # 160 = 128 + 32, 200 = 128 + 72, o_lora 72 (wo_a's groups start inside a block row)
    "hub-partial-160": (
        dict(
            hidden_size=160,
            num_attention_heads=2,
            head_dim=96,
            q_lora_rank=200,
            o_groups=2,
            o_lora_rank=72,
            moe_intermediate_size=96,
            index_n_heads=8,
            index_head_dim=48,
            layer_types=["compressed_sparse_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["moe", "hash_moe", "moe"],
            compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 2},
            index_topk=1,
        ),
        False,
        True,
    ),
    # V4.1 (Engram on layers 0 and 2), transformers' names with .weight_scale_inv
    "v41-transformers-names": (dict(moe_intermediate_size=32, index_n_heads=8), True, False),
    # expert_dtype fp8: the routed experts FP8 too (ue8m0 128 x 128), through the plugin's FP8 path
    "hub-fp8-experts": (dict(moe_intermediate_size=64, index_n_heads=8), False, True),
}


def deepseek(name: str, root: Path) -> Made:
    import helpers.deepseek_v4_quant as q
    from helpers.deepseek_v4 import PROMPTS

    overrides, v41, hub = DS_CASES[name]
    q.save_float_v4(root / "float", seed=len(name) + 11, **overrides)
    if v41:
        q.add_engram(root / "float", seed=len(name))
    folder = root / "q"
    q.quantize_folder(root / "float", folder, hub=hub, scale_suffix=".scale" if hub else ".weight_scale_inv", mtp=hub)
    if name == "hub-fp8-experts":
        _fp8_experts(root / "float", folder)
    if not v41:
        q.dequantized_folder(folder, root / "deq")
        return Made(folder, *_hf(q.hf_load(root / "deq")), PROMPTS)
    # V4.1 is not a transformers model: the reference is our CPU path on the quantized folder
    ours = _v41_model(folder)

    def logits(ids: list[int]) -> np.ndarray:
        from engram_trt.models.step import PackedStep

        with torch.no_grad():
            return (
                ours.forward_step(
                    PackedStep(torch.tensor(ids), [len(ids)], [0], [0]), ours.new_cache(1, MAX_LEN), all_logits=True
                )
                .double()
                .numpy()
            )

    return Made(
        folder, logits, lambda prompts: [ours.generate_greedy(p, NEW_TOKENS, ignore_eos=True) for p in prompts], PROMPTS
    )


def _fp8_experts(src: Path, folder: Path) -> None:
    """The routed experts of a hub-layout folder re-stored FP8 (ue8m0 128 x 128 blocks,
    ``.scale`` beside each) from the float folder, ``expert_dtype: "fp8"``."""
    import helpers.deepseek_v4_quant as q
    from safetensors.torch import load_file, save_file

    from engram_trt.quant.formats import quantize_fp8

    floats = load_file(str(src / "model.safetensors"))
    tensors = load_file(str(folder / "model.safetensors"))
    for name, t in floats.items():
        hub = q.hub_name(name)
        if q.ROUTED.search(hub):
            tensors[hub], tensors[hub[: -len(".weight")] + ".scale"] = quantize_fp8(t, (128, 128), "ue8m0")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((folder / "config.json").read_text())
    d["expert_dtype"] = "fp8"
    (folder / "config.json").write_text(json.dumps(d, indent=1))


def _v41_model(folder: Path) -> Any:
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.tables.base import TableStore

    ckpt = open_checkpoint(folder)
    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    lids = ckpt.config.engram.layer_ids
    model.set_tables(
        TableStore.from_tensors(
            [ckpt.get(f"model.layers.{lid}.engram.embed.weight") for lid in lids], [None] * len(lids), 32, lids
        )
    )
    return model


MAKERS = {"llama": llama, "qwen4": qwen4, "deepseek": deepseek}
GRAPH_CASES = [
    ("llama", "tied-ue8m0-partly-float"),
    ("llama", "partial-blocks"),
    ("qwen4", "ple-fp8-float-scales"),
    ("qwen4", "experts-i64-straddle"),
    ("deepseek", "hub-small"),
    ("deepseek", "hub-partial-160"),
    ("deepseek", "v41-transformers-names"),
    ("deepseek", "hub-fp8-experts"),
]
_MADE: dict[tuple[str, str], Made] = {}


def made(family: str, name: str, tmp_path_factory: Any) -> Made:
    """Each case's folder and reference, made once per session."""
    if (family, name) not in _MADE:
        _MADE[(family, name)] = MAKERS[family](name, tmp_path_factory.mktemp(f"{family}-{name}"))
    return _MADE[(family, name)]


# ------------------------------------------------------------------------------ the graph
def _runner(ckpt: Any, exported: Any) -> Any:
    """The architecture's reference runner of the exported graph (tables bound)."""
    arch = ckpt.architecture.name
    if arch == "engram-llama":
        from engram_trt.models.engram_llama.reference_runner import ReferenceRunner

        return ReferenceRunner(exported, ckpt.config, num_slots=4, max_seq_len=MAX_LEN)
    if arch == "qwen4-exp":
        from engram_trt.models.qwen4_exp.reference_runner import Qwen4ExpReferenceRunner, ple_tables_of

        return Qwen4ExpReferenceRunner(exported, ckpt.config, ple_tables_of(ckpt), num_slots=4, max_seq_len=MAX_LEN)
    import ml_dtypes

    from engram_trt.models.deepseek_v4.reference_runner import DeepseekV4ReferenceRunner
    from engram_trt.checkpoint.vocab import engram_lookup_and_layout

    cfg = ckpt.config
    tables, lookup = [], None
    if cfg.engram is not None:
        lookup, _layout = engram_lookup_and_layout(ckpt)
        tables = [
            (
                ckpt.get(f"model.layers.{lid}.engram.embed.weight").view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                None,
            )
            for lid in cfg.engram.layer_ids
        ]
    return DeepseekV4ReferenceRunner(exported, cfg, tables, lookup, num_slots=4, max_seq_len=MAX_LEN)


def export(ckpt: Any, dtype: str = "fp32") -> Any:
    from engram_trt.models.export import ExportOptions

    cfg = ckpt.config
    layout, table_dtype = None, None
    if getattr(cfg, "engram", None) is not None:
        from engram_trt.checkpoint.vocab import engram_lookup_and_layout

        _lookup, layout = engram_lookup_and_layout(ckpt)
    if getattr(cfg, "ple", None) is not None:
        table_dtype = ckpt.architecture.table_dtype(list(ckpt.architecture.table_refs(ckpt)))
    return ckpt.architecture.export_onnx(
        cfg, ckpt.lazy(), layout, ExportOptions(dtype=dtype, max_position=MAX_LEN, table_dtype=table_dtype)
    )


def stored_fp8_weights(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every F8_E4M3 tensor of a folder and its shape (from the headers)."""
    from safetensors import safe_open

    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if h.get_slice(k).get_dtype() == "F8_E4M3":
                    out[k] = tuple(h.get_slice(k).get_shape())
    return out


def s_not(name: str) -> bool:
    """Not a DequantizeLinear's scale (``<weight>.e4m3_scale``)."""
    return not name.endswith(".e4m3_scale")


@pytest.mark.parametrize("family,name", GRAPH_CASES, ids=[f"{f}-{n}" for f, n in GRAPH_CASES])
def test_exported_graph_equals_the_reference(family: str, name: str, tmp_path_factory: Any) -> None:
    from onnx import TensorProto

    from engram_trt.models.registry import open_checkpoint

    m = made(family, name, tmp_path_factory)
    ckpt = open_checkpoint(m.folder)
    assert ckpt.architecture.engine_problems(ckpt) == []
    exported = export(ckpt)
    graph = exported.model.graph
    inits = {i.name: i for i in graph.initializer}
    e4m3 = [i for i in graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN]
    deq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert e4m3 and {n.input[0] for n in deq} == {i.name for i in e4m3}
    for n in deq:  # blocked along the weight's columns, scales [N, Kp / bk] float32
        attrs = {a.name: a.i for a in n.attribute}
        w, s = inits[n.input[0]], inits[n.input[1]]
        assert attrs["axis"] == 1 and s.data_type == TensorProto.FLOAT
        assert list(s.dims) == [w.dims[0], w.dims[1] // attrs["block_size"]] and w.dims[1] % attrs["block_size"] == 0
    fp8 = stored_fp8_weights(m.folder)
    routed = [n for n in graph.node if n.op_type == ROUTED]
    in_nodes = sum(len(n.input) for n in routed)
    # no float initializer made of an FP8 weight (nothing dequantized into the graph)
    floats = [
        i.name
        for i in graph.initializer
        if i.data_type in (TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16) and s_not(i.name)
    ]
    for n in fp8:
        base = n[len("model.") :] if n.startswith("model.") else n
        assert not [f for f in floats if base in f], n
    want_routed = {
        ("qwen4", "ple-fp8-float-scales"): 4,
        ("deepseek", "hub-small"): 3,
        ("deepseek", "hub-partial-160"): 3,
        ("deepseek", "v41-transformers-names"): 3,
        ("deepseek", "hub-fp8-experts"): 3,
    }.get((family, name), 0)
    assert len(routed) == want_routed and in_nodes == 9 * want_routed
    for n in routed:  # the stored bytes as INT8 initializers
        assert all(inits[i].data_type == TensorProto.INT8 for i in n.input[3::2])
    # every stored FP8 byte is in the graph once (an FP4 expert's bytes are the routed nodes')
    e4m3_bytes = sum(int(np.prod(i.dims)) for i in e4m3)
    routed_fp8 = sum(
        int(np.prod(inits[i].dims))
        for n in routed
        for i in n.input[3::2]
        if any(a.name == "w_type" and a.i == 0 for a in n.attribute)
    )
    assert e4m3_bytes + routed_fp8 >= sum(int(np.prod(s)) for s in fp8.values())  # (+ partial blocks' zero columns)
    runner = _runner(ckpt, exported)
    refs = [m.logits(p + e) for p, e in zip(m.prompts, EXTRA)]
    slots, lens = [3, 0, 2], [len(p) for p in m.prompts]
    got = [runner.step(np.array(sum(m.prompts, [])), np.cumsum([0, *lens]), [0, 0, 0], slots)]
    at = [[n - 1 for n in lens]]
    for d in range(2):
        got.append(runner.step(np.array([e[d] for e in EXTRA]), np.arange(4), lens, slots))
        at.append(list(lens))
        lens = [n + 1 for n in lens]
    for k, (logits, positions) in enumerate(zip(got, at)):
        assert logits.dtype == np.float32
        for s, pos in enumerate(positions):
            ref = refs[s][pos]
            err = np.abs(logits[s] - ref).max()
            assert err <= 1e-4 * np.abs(ref).max(), (family, name, k, s, pos, err)
    ckpt.close()


def test_exported_quantized_graph_is_deterministic(tmp_path_factory: Any) -> None:
    from engram_trt.models.registry import open_checkpoint

    m = made("deepseek", "hub-small", tmp_path_factory)
    ckpt = open_checkpoint(m.folder)
    a, b = export(ckpt, "bf16"), export(ckpt, "bf16")
    assert a.model.SerializeToString(deterministic=True) == b.model.SerializeToString(deterministic=True)
    ckpt.close()


# ------------------------------------------------------------------------------ the engines
def _build(ck: Path, out: Path, *extra: str) -> dict[str, Any]:
    buf = io.StringIO()
    argv = [
        "build",
        str(ck),
        "--output",
        str(out),
        "--json",
        "--max-batch",
        "4",
        "--max-seq-len",
        str(MAX_LEN),
        "--max-num-tokens",
        str(MAX_LEN),
        *extra,
    ]
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


ENGINE_CASES = [
    ("llama", "partial-blocks"),
    ("qwen4", "ple-fp8-float-scales"),
    ("deepseek", "hub-small"),
    ("deepseek", "v41-transformers-names"),
    ("deepseek", "hub-fp8-experts"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: Any) -> dict[str, Any]:
    why = engine_skip_reason((ROUTED, "EngramAttention", "EngramDsv4Attention"))
    root = tmp_path_factory.mktemp("quant-engines")
    out = {"why": why}
    for family, name in ENGINE_CASES:
        m = made(family, name, tmp_path_factory)
        engine = root / f"{family}-{name}"
        out[(family, name)] = (m, engine, _build(m.folder, engine, *(["--no-engine"] if why else [])))
    return out


def test_engines_build_for_the_fp8_targets_with_the_plugins(built: dict[str, Any]) -> None:
    for family, name in ENGINE_CASES:
        m, engine, report = built[(family, name)]
        manifest = json.loads((engine / "manifest.json").read_text())
        assert manifest["build_flags"]["targets"] == FP8_TARGETS
        if built["why"]:
            continue
        assert report["engine_skipped"] is None and (engine / "model.engine").stat().st_size == report["engine_bytes"]
        layers = [p.split("/")[0] for p in report["plugin_layers"]]
        want = {"llama": 0, "qwen4": 4, "deepseek": 3}[family]
        assert layers.count(ROUTED) == want, layers
    if built["why"]:
        pytest.skip(built["why"])


def test_engine_folders_give_the_reference_tokens(built: dict[str, Any], capsys: Any) -> None:
    for family, name in ENGINE_CASES:
        m, engine, _report = built[(family, name)]
        want = m.greedy(m.prompts)
        assert llm_greedy(engine, m.prompts, NEW_TOKENS) == want, (family, name)
        res = run_json(engine, m.prompts[1], NEW_TOKENS, capsys)
        assert res["token_ids"] == want[1] and res["source"] == "engine"


def test_served_fp4_engine_folder_gives_the_reference_tokens(built: dict[str, Any]) -> None:
    require_tritonserver()
    m, engine, _report = built[("deepseek", "hub-small")]
    want = m.greedy(m.prompts[:2])
    proc, info = start_serve(
        engine,
        engine.parent / "tritonserver.log",
        "--device",
        "cpu",
        "--max-batch-size",
        "4",
        "--max-num-tokens",
        str(MAX_LEN),
    )
    try:
        assert_served_tokens(info["http"], m.prompts[:2], want, NEW_TOKENS)
    finally:
        if proc.poll() is None:
            stop_serve(proc)


def test_fp8_engine_holds_the_stored_bytes(tmp_path: Path) -> None:
    """Two Llamas of 512-wide attention whose MLPs differ (1024 / 2048 wide: the same kernels,
    more weights), every projection FP8 in 128 x 128 blocks with float32 scales: their
    engines differ by 0.95-1.15 bytes per FP8 value of the difference (one byte a value plus
    4 / 128 bytes of float32 scales, where a weight dequantized at build would cost two
    (bf16) or four); and the larger's engine is smaller than its dequantized twin's (bf16
    weights) by those bytes less a fixed allowance for the FP8 kernels. The plugin library
    stays outside the engines (--plugin-library reference), one target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import helpers.llama_fp8 as t

    why = engine_skip_reason(("EngramAttention",))
    if why:
        pytest.skip(why)
    sizes, values = {}, {}
    for inter in (1024, 2048):
        cfg = dict(t.BASE, hidden_size=512, intermediate_size=inter, num_attention_heads=8, num_key_value_heads=4)
        torch.manual_seed(1)
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(tmp_path / f"float{inter}")
        word_tokenizer(tmp_path / f"float{inter}" / "tokenizer.json", t.VOCAB)
        fp8 = t.partial_block_folder(tmp_path / f"float{inter}", tmp_path / f"fp8-{inter}")
        values[inter] = sum(int(np.prod(s)) for s in stored_fp8_weights(fp8).values())
        assert values[inter] == 2 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * inter)
        sizes[inter] = _build(fp8, tmp_path / f"e8-{inter}", "--plugin-library", "reference", "--target", "sm89")[
            "engine_bytes"
        ]
    slope = (sizes[2048] - sizes[1024]) / (values[2048] - values[1024])
    assert 0.95 <= slope <= 1.15, (sizes, values)
    deq = dequantized_folder(tmp_path / "fp8-2048", tmp_path / "deq")
    twin = _build(deq, tmp_path / "e16", "--plugin-library", "reference", "--target", "sm89")["engine_bytes"]
    # bf16's two bytes a value against one plus 4/128 of scales, less a fixed 1.5 MiB (the FP8
    # GEMMs' kernels: 1.07 MiB measured with TensorRT-RTX 1.7.1); a dequantized weight would save nothing
    assert twin - sizes[2048] >= (1 - 4 / 128) * values[2048] - 1.5 * 2**20, (twin, sizes, values)


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("targets", ["sm80", "sm89,sm86", "75,sm120"])
def test_fp8_with_an_older_target_is_refused_in_one_line(
    targets: str, tmp_path_factory: Any, tmp_path: Path, capsys: Any
) -> None:
    m = made("deepseek", "hub-small", tmp_path_factory)
    capsys.readouterr()
    code = main(["build", str(m.folder), "--output", str(tmp_path / "engine"), "--target", targets, "--no-engine"])
    err = capsys.readouterr().err.strip()
    older = ",".join(
        t if t.startswith("sm") else "sm" + t for t in targets.split(",") if t.lstrip("sm") in ("75", "80", "86")
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--target {older}: tensor " in err and "is stored FP8 (F8_E4M3)" in err
    assert "pass --target sm89,sm120,sm121 (or leave --target out)" in err
    assert not (tmp_path / "engine").exists()


def test_fp4_experts_the_plugin_cannot_take_are_refused_in_one_line(tmp_path: Path, capsys: Any) -> None:
    """FP4 experts of 48 inputs (a partial 32-group: the format allows it, the kernels'
    16-byte vectors do not): served by the torch backend, refused by build before any work."""
    import helpers.deepseek_v4_quant as q
    from safetensors.torch import load_file, save_file

    from engram_trt.quant.formats import pack_fp4

    q.save_float_v4(tmp_path / "float", seed=3, moe_intermediate_size=48, index_n_heads=8)
    tensors = load_file(str(tmp_path / "float" / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    for name in [n for n in tensors if q.ROUTED.search(n)]:
        N, K = tensors[name].shape
        tensors[name] = pack_fp4(torch.randint(0, 16, (N, K), generator=gen)).view(torch.int8)
        tensors[name[: -len(".weight")] + ".weight_scale_inv"] = torch.randint(
            120, 130, (N, -(-K // 32)), generator=gen, dtype=torch.uint8
        ).view(torch.float8_e8m0fnu)
    save_file(tensors, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((tmp_path / "float" / "config.json").read_text())
    d["quantization_config"] = dict(q.QUANT_CONFIG)
    d["expert_dtype"] = "fp4"
    (tmp_path / "float" / "config.json").write_text(json.dumps(d))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "float"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []
    code = main(["build", str(tmp_path / "float"), "--output", str(tmp_path / "engine"), "--no-engine"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "FP4 routed experts with hidden_size=32 and moe_intermediate_size=48" in err
    assert "multiples of 32; serve this checkpoint with the torch backend" in err
    assert not (tmp_path / "engine").exists()
