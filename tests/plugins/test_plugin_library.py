"""The native library (libengram_trt_plugins.so) on a machine without a GPU.

- its exported symbols are exactly the registration entry points and the kernels' C ABI;
- the C ABI's host-side checks (layout, table format) and the ctypes bindings'
  argument checks run without a GPU;
- with TensorRT-RTX: the library loads through the plugin registry, the creators
  are listed with their fields, refuse out-of-range or malformed fields (createPlugin
  needs no GPU), an ONNX graph holding EngramHash -> EngramGather -> wkv ->
  EngramGate builds into an engine on the CPU, and so do graphs whose gate takes fp16
  or fp32 hidden / kv (the output takes hidden's type); an EngramAttention graph builds
  with its caches aliased in place, and only with the aliasing preview feature.
The kernels themselves run on the H200 through tests/gpu (test_verify.py,
test_attention.py; docs/benchmarks.md).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engram_trt.native import attention as attention_kernels
from engram_trt.native import gate as gate_kernels
from engram_trt.native import gather as gather_kernels
from engram_trt.native import hash as hash_kernels
from engram_trt.native import hostgather
from engram_trt.native import library as kernel_library
from engram_trt.native import trt_compat
from engram_trt.config.model import EngramSpec
from engram_trt.distributed.sharding import ColumnShard, shard_columns
from engram_trt.errors import EngramError
from engram_trt.engram.layout import EngramLayout

from helpers.plugins import create_plugin, harness_path, harness_scripts, parse_plugin_graph, plugin_builder_config
from helpers.files import REPO

NAMESPACE = "engram_trt"  # the creators' plugin namespace (plugins/common/engramPluginBase.h)
HEADER = REPO / "plugins" / "kernels" / "engramKernels.h"
PLUGINS = {
    "EngramHash": [
        "n_layers",
        "max_ngram_size",
        "n_heads",
        "pad_id",
        "compressed_vocab_size",
        "primes",
        "offsets",
        "multipliers",
    ],
    "EngramGather": [
        "layer_index",
        "n_layers",
        "n_cols",
        "head_dim",
        "table_dtype",
        "quant_block",
        "num_rows",
        "bad_rows_input",
        "column_begin",
        "column_end",
        "row_offset",
    ],
    "EngramGate": ["hc_mult", "hidden_size", "eps"],
    "EngramAttention": ["num_heads", "num_kv_heads", "head_dim", "scale"],
    "EngramPleHash": [
        "ngram_size",
        "heads_per_ngram",
        "eos_id",
        "vocab_size",
        "table_rows",
        "multipliers",
        "primes",
        "offsets",
    ],
}


def _abi_names() -> set[str]:
    """Every ENGRAM_API function the header declares (with the headers it includes from
    the kernel library: quantKernels.h)."""
    text = HEADER.read_text()
    for included in re.findall(r'^#include "(\w+\.h)"', text, re.M):
        text += (HEADER.parent / included).read_text()
    return set(re.findall(r"ENGRAM_API\s+[\w\s\*]+?\b(engram_\w+)\s*\(", text))


def test_exported_symbols_are_the_abi_and_nothing_else(plugin_lib: Path) -> None:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(plugin_lib)], check=True, capture_output=True, text=True
    ).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    expected = {"getCreators", "setLoggerFinder"} | _abi_names()
    assert "engram_gather" in expected and "engram_host_gather" in expected  # the header parse found the ABI
    assert exported == expected, f"unexpected: {sorted(exported - expected)}, missing: {sorted(expected - exported)}"
    # no libnvinfer / libcudart dependency: the library must load where only TensorRT-RTX exists
    needed = (
        subprocess.run(["readelf", "-d", str(plugin_lib)], capture_output=True, text=True).stdout
        if shutil.which("readelf")
        else ""
    )
    assert "libnvinfer" not in needed and "libcudart" not in needed


def test_version_matches_the_header(plugin_lib: Path) -> None:
    declared = re.search(r'#define ENGRAM_TRT_PLUGIN_VERSION "([^"]+)"', HEADER.read_text()).group(1)
    assert kernel_library.version() == declared


def test_layout_checks_run_without_gpu(plugin_lib: Path, layout: EngramLayout) -> None:
    hash_kernels.check_layout(layout)  # the real layout passes

    too_big = EngramLayout(**{**layout.__dict__, "multipliers": layout.multipliers.copy()})
    too_big.multipliers[1, 2] = np.iinfo(np.int64).max // (layout.compressed_vocab_size - 1) + 1
    with pytest.raises(EngramError, match=r"multiplier\[5\]"):
        hash_kernels.check_layout(too_big)

    wide = EngramLayout(**{**layout.__dict__, "offsets": layout.offsets.copy()})
    wide.offsets[0, -1] = 2**31 - 2
    with pytest.raises(EngramError, match="fit int32"):
        hash_kernels.check_layout(wide)


def test_bindings_name_the_bad_argument() -> None:
    import torch

    class Lay:  # only the fields hash_packed reads before the device check
        max_ngram_size, num_layers, n_hash_cols = 3, 1, 2

    with pytest.raises(EngramError, match="^ids must be a CUDA tensor"):
        hash_kernels.hash_packed(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), None, Lay())
    with pytest.raises(EngramError, match="^ids must have dtype torch.int32"):
        hash_kernels.hash_packed(torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), None, Lay())
    kv, w = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(1, 8)
    with pytest.raises(
        EngramError,
        match=r"^hidden must have dtype torch.bfloat16 or torch.float16 or torch.float32 "
        r"\(got torch.float64\)$",
    ):
        gate_kernels.gate(torch.zeros(2, 1, 8, dtype=torch.float64), kv, w, w, eps=1e-6)
    with pytest.raises(
        EngramError, match="^hidden, kv and out must share one dtype .*; got hidden torch.float32, kv torch.bfloat16$"
    ):
        gate_kernels.gate(torch.zeros(2, 1, 8), kv, w, w, eps=1e-6)
    with pytest.raises(EngramError, match="got hidden torch.float16, kv torch.float16, out torch.bfloat16$"):
        gate_kernels.gate(
            torch.zeros(2, 1, 8, dtype=torch.float16),
            kv.half(),
            w,
            w,
            eps=1e-6,
            out=torch.zeros(2, 1, 8, dtype=torch.bfloat16),
        )
    with pytest.raises(
        EngramError, match=r"^q_weight must have dtype torch.bfloat16 or torch.float32 \(got torch.float16\)"
    ):
        gate_kernels.gate(torch.zeros(2, 1, 8, dtype=torch.bfloat16), kv, w.half(), w.half(), eps=1e-6)
    with pytest.raises(EngramError, match=r"^k_weight must have dtype torch.float16 \(got torch.float32\)"):
        gate_kernels.gate(torch.zeros(2, 1, 8, dtype=torch.float16), kv.half(), w.half(), w, eps=1e-6)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # all three I/O types pass the dtype checks
        with pytest.raises(EngramError, match="^hidden must be a CUDA tensor"):
            gate_kernels.gate(torch.zeros(2, 1, 8, dtype=dtype), kv.to(dtype), w.to(dtype), w.to(dtype), eps=1e-6)
    with pytest.raises(EngramError, match=r"^ids must be a CUDA tensor"):
        gather_kernels.gather(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(10, 64, dtype=torch.uint8))


def test_gate_abi_refuses_bad_types_before_any_cuda_call(plugin_lib: Path) -> None:
    """engram_gate_typed's type checks (I/O type, weight type vs I/O type) and the bf16-only
    engram_gate's weight check run on the host: no GPU needed, one-line reasons."""
    import ctypes

    lib = gate_kernels.library()
    p = ctypes.c_void_p(16)  # never read: the calls fail on their types first

    def typed(io_type: int, weight_type: int) -> tuple[int, str]:
        status = lib.engram_gate_typed(
            p,
            p,
            io_type,
            p,
            p,
            weight_type,
            None,
            gate_kernels.MASK_NONE,
            4,
            2,
            64,
            ctypes.c_float(1e-6),
            ctypes.c_float(1e-6),
            p,
            None,
        )
        return status, lib.engram_last_error().decode()

    assert typed(3, kernel_library.FLOAT_BF16) == (1, "engram_gate: io_type 3 is not bf16 (0), fp32 (1) or fp16 (2)")
    assert typed(kernel_library.FLOAT_BF16, kernel_library.FLOAT_F16) == (
        1,
        "engram_gate: weight_type 2 is neither bf16 (0), fp32 (1) nor the io_type (0, bf16)",
    )
    assert typed(kernel_library.FLOAT_F32, kernel_library.FLOAT_F16)[0] == 1
    status = lib.engram_gate(
        p,
        p,
        p,
        p,
        gate_kernels.WEIGHT_F16,
        None,
        gate_kernels.MASK_NONE,
        4,
        2,
        64,
        ctypes.c_float(1e-6),
        ctypes.c_float(1e-6),
        p,
        None,
    )
    assert (status, lib.engram_last_error().decode()) == (
        1,
        "engram_gate: weight_type 2 is neither bf16 (0) nor fp32 (1)",
    )
    # zero tokens: every type combination is valid and nothing is launched
    for io_type, weight_types in (
        (kernel_library.FLOAT_BF16, (0, 1)),
        (kernel_library.FLOAT_F16, (0, 1, 2)),
        (kernel_library.FLOAT_F32, (0, 1)),
    ):
        for wt in weight_types:
            status = lib.engram_gate_typed(
                p,
                p,
                io_type,
                p,
                p,
                wt,
                None,
                gate_kernels.MASK_NONE,
                0,
                2,
                64,
                ctypes.c_float(1e-6),
                ctypes.c_float(1e-6),
                p,
                None,
            )
            assert status == 0, lib.engram_last_error().decode()


def test_attention_abi_checks_run_without_gpu(plugin_lib: Path) -> None:
    """The attention entry points refuse bad shapes, types and pointers on the host, with
    one-line reasons, before any CUDA call; zero tokens launch nothing."""
    import ctypes

    lib = attention_kernels.library()
    p = ctypes.c_void_p(16)  # never read: the calls fail on their arguments first

    def packed(io_type=kernel_library.FLOAT_BF16, T=4, H=8, kvh=2, hd=64, slots=4, max_len=32, scale=0.125, q=p):
        status = lib.engram_attention_packed(
            q, io_type, p, p, p, p, T, H, kvh, hd, slots, max_len, ctypes.c_float(scale), None, 0, p, None
        )
        return status, lib.engram_last_error().decode()

    assert packed(H=6, kvh=4) == (
        1,
        "engram_attention_packed: num_heads must be a positive multiple of num_kv_heads "
        "(got num_heads 6, num_kv_heads 4)",
    )
    assert packed(hd=264) == (1, "engram_attention_packed: head_dim must be a multiple of 8 in [8, 256] (got 264)")
    assert packed(scale=float("nan"))[1] == "engram_attention_packed: scale must be finite and > 0 (got nan)"
    assert packed(io_type=3) == (1, "engram_attention_packed: io_type 3 is not bf16 (0), fp32 (1) or fp16 (2)")
    assert packed(T=-1)[1].startswith("engram_attention_packed: num_tokens must be in [0, 2^31 - 1]")
    assert packed(slots=0)[1].startswith("engram_attention_packed: num_slots and max_seq_len must be in [1, 2^31 - 1]")
    assert packed(q=ctypes.c_void_p(24)) == (
        1,
        "engram_attention_packed: q, key_cache, value_cache and out must be 16-byte aligned device pointers",
    )
    assert packed(T=0) == (0, "")  # nothing to do, nothing launched
    status = lib.engram_kv_cache_write(p, p, kernel_library.FLOAT_F16, None, p, 3, 2, 64, p, p, 4, 32, None)
    assert (status, lib.engram_last_error().decode()) == (
        1,
        "engram_kv_cache_write: token_slot and token_pos must be int32 device arrays",
    )
    status = lib.engram_attention_step(
        p, p, p, kernel_library.FLOAT_F32, p, p, 0, 8, 2, 64, p, p, 4, 32, ctypes.c_float(0.125), None, 0, p, None
    )
    assert status == 0
    attention_kernels.check_attention_shape(32, 8, 128, 128**-0.5)
    with pytest.raises(
        EngramError, match="num_kv_heads \\* ceil\\(num_heads / num_kv_heads / 8\\) = 65536 exceeds 65535"
    ):
        attention_kernels.check_attention_shape(65536 * 8, 65536, 64, 0.1)


def test_attention_workspace_covers_the_key_splits(plugin_lib: Path) -> None:
    """Steps of few tokens split each token's keys over blocks of >= 256 positions (at most
    32 splits, until a step has 1024 blocks) and need T * heads * splits * (head_dim + 2)
    floats of workspace; a step with enough blocks, or a short cache, needs none. The size
    for up to max_tokens is the largest of any step up to that many tokens."""

    def expected(T: int, H: int, kvh: int, hd: int, max_len: int) -> int:
        blocks = T * kvh * -(-(H // kvh) // 8)
        splits = 1
        if blocks < 1024:
            splits = max(1, min(-(-1024 // blocks), -(-max_len // 256), 32))
        keys = -(-(-(-max_len // splits)) // 32) * 32
        splits = -(-max_len // keys)
        return 0 if splits == 1 else T * H * splits * (hd + 2) * 4

    for H, kvh, hd, max_len in ((32, 8, 128, 4096), (16, 1, 64, 8192), (8, 8, 64, 300), (40, 2, 256, 2048)):
        for T in (1, 2, 3, 7, 64, 127, 128, 256):
            one = attention_kernels.attention_workspace_size(T, H, kvh, hd, max_len)
            most = max(expected(t, H, kvh, hd, max_len) for t in range(1, T + 1))
            assert one == most, (H, kvh, hd, max_len, T)
    assert attention_kernels.attention_workspace_size(1, 32, 8, 128, 4096) == 32 * 16 * 130 * 4  # 16 splits of 256 keys
    assert attention_kernels.attention_workspace_size(1, 8, 8, 64, 200) == 0  # one split covers a 200-position cache
    assert attention_kernels.attention_workspace_size(0, 32, 8, 128, 4096) == 0


def test_attention_bindings_name_the_bad_argument() -> None:
    import torch

    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    kv = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16)
    idx = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(
        EngramError,
        match=r"^key_cache must have dtype torch.bfloat16 or torch.float16 or torch.float32 "
        r"\(got torch.float64\)$",
    ):
        attention_kernels.attention_step(q, kv, kv, cache.double(), cache, idx, idx)
    with pytest.raises(EngramError, match=r"^q must have dtype torch.bfloat16 \(got torch.float16\)$"):
        attention_kernels.attention_step(q.half(), kv, kv, cache, cache, idx, idx)
    with pytest.raises(
        EngramError,
        match=r"^key_cache and value_cache must be one shape .* \(got \(4, 2, 32, 64\) "
        r"and \(4, 2, 16, 64\)\)$",
    ):
        attention_kernels.attention_step(q, kv, kv, cache, cache[:, :, :16], idx, idx)
    with pytest.raises(EngramError, match=r"^token_pos must have dtype torch.int32 \(got torch.int64\)$"):
        attention_kernels.attention_step(q, kv, kv, cache, cache, idx, idx.long())
    with pytest.raises(EngramError, match=r"^k must be \[T, num_kv_heads, head_dim\] = \(3, 2, 64\)"):
        attention_kernels.kv_cache_write(kv[:, :1], kv, cache, cache, idx, idx)
    with pytest.raises(EngramError, match=r"^token_slot must be \[T\] = \(3,\) \(got \(2,\)\)$"):
        attention_kernels.attention_packed(q, cache, cache, idx[:2], idx)
    with pytest.raises(EngramError, match="^q must be a CUDA tensor"):
        attention_kernels.attention_packed(q, cache, cache, idx, idx)


def test_host_gatherer_create_reports_a_missing_device(plugin_lib: Path) -> None:
    """Without a GPU the gatherer's first CUDA call, cudaGetDevice, fails: that is the
    error reported (it used to be ignored, and a later allocation failed instead)."""
    import ctypes

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gatherer would be created")
    lib = hostgather.library()
    handle = ctypes.c_void_p(1)
    status = lib.engram_host_gatherer_create(2, 64, 64, ctypes.byref(handle))
    assert status != 0 and handle.value is None
    assert "engram_host_gatherer_create: cudaGetDevice failed" in lib.engram_last_error().decode()


# --- TensorRT-RTX ------------------------------------------------------------------------

# (the trt fixture: tests/conftest.py)


def test_creators_are_registered_with_their_fields(trt) -> None:
    registry = trt.module.get_plugin_registry()
    found = {}
    for creator in registry.all_creators:
        if creator.name in PLUGINS:
            found[creator.name] = (
                creator.plugin_version,
                creator.plugin_namespace,
                [f.name for f in creator.field_names],
            )
    assert set(found) == set(PLUGINS)
    for name, fields in PLUGINS.items():
        assert found[name] == ("1", NAMESPACE, fields)
    # the type and length each field is declared with (what the ONNX parser converts an
    # attribute to; 0: an array whose length follows from other fields)
    i32, i64, f32 = (
        trt.module.PluginFieldType.INT32,
        trt.module.PluginFieldType.INT64,
        trt.module.PluginFieldType.FLOAT32,
    )
    declared = {
        name: [(f.type, f.size) for f in registry.get_creator(name, "1", NAMESPACE).field_names] for name in PLUGINS
    }
    assert declared == {
        "EngramHash": [(i32, 1)] * 3 + [(i64, 1)] * 2 + [(i64, 0)] * 3,
        "EngramGather": [(i32, 1)] * 6 + [(i64, 1)] + [(i32, 1)] * 3 + [(i64, 1)],
        "EngramGate": [(i32, 1), (i32, 1), (f32, 1)],
        "EngramAttention": [(i32, 1)] * 3 + [(f32, 1)],
        "EngramPleHash": [(i32, 1)] * 2 + [(i64, 1)] * 3 + [(i64, 0)] * 3,
    }
    # nothing of ours registers in the empty namespace, where another library's plugins
    # of the same names could collide
    assert all(trt.module.get_plugin_registry().get_creator(name, "1", "") is None for name in PLUGINS)


def _engram_graph(
    layout: EngramLayout,
    path: Path,
    head_dim: int = 64,
    hc: int = 2,
    hidden: int = 128,
    bad_rows_input: bool = False,
    shard: ColumnShard | None = None,
) -> None:
    """ids -> EngramHash -> EngramGather (layer 1, fp8 table by address) -> wkv -> EngramGate.
    ``bad_rows_input``: the gather takes the bad-row counter's address too. ``shard``: a
    tensor-parallel rank's engine, whose gather reads only the shard's columns from its row
    slice (column_begin / column_end / row_offset, the slice's num_rows)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = layout.max_ngram_size - 1
    cols = layout.n_hash_cols if shard is None else shard.num_cols  # the gather's output columns
    share = (
        {}
        if shard is None
        else {"column_begin": shard.col_begin, "column_end": shard.col_end, "row_offset": shard.row_begin[1]}
    )
    num_rows = int(layout.table_rows[1]) if shard is None else shard.num_rows(1)
    rng = np.random.default_rng(0)

    def bf16_init(name, shape):
        import torch

        t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.05).to(torch.bfloat16)
        return helper.make_tensor(name, TensorProto.BFLOAT16, shape, t.view(torch.int16).numpy().tobytes(), raw=True)

    def i64(name, values):
        # int64 arrays travel as decimal text (STRING attribute): the ONNX parser narrows
        # INTS attributes to int32, which would truncate the multipliers.
        return ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))

    ns = {"plugin_namespace": NAMESPACE}
    counter = {"bad_rows_input": 1} if bad_rows_input else {}
    nodes = [
        helper.make_node(
            "EngramHash",
            ["ids", "seq_starts", "lookback"],
            ["hash_ids"],
            name="hash",
            domain="engram_trt",
            plugin_version="1",
            **ns,
            n_layers=layout.num_layers,
            max_ngram_size=layout.max_ngram_size,
            n_heads=layout.n_heads,
            pad_id=layout.pad_id,
            compressed_vocab_size=layout.compressed_vocab_size,
            primes=i64("primes", layout.primes),
            offsets=i64("offsets", layout.offsets),
            multipliers=i64("multipliers", layout.multipliers),
        ),
        helper.make_node(
            "EngramGather",
            ["hash_ids", "rows_addr", "scales_addr"] + (["bad_rows_addr"] if bad_rows_input else []),
            ["rows"],
            name="gather",
            domain="engram_trt",
            plugin_version="1",
            **ns,
            layer_index=1,
            n_layers=layout.num_layers,
            n_cols=layout.n_hash_cols,
            head_dim=head_dim,
            table_dtype=0,
            quant_block=32,
            num_rows=num_rows,
            **counter,
            **share,
        ),
        helper.make_node("Reshape", ["rows", "flat_shape"], ["rows_flat"], name="flatten"),
        helper.make_node("MatMul", ["rows_flat", "wkv"], ["kv"], name="wkv"),
        helper.make_node(
            "EngramGate",
            ["hidden", "kv", "q_weight", "k_weight", "mask"],
            ["out"],
            name="gate",
            domain="engram_trt",
            plugin_version="1",
            **ns,
            hc_mult=hc,
            hidden_size=hidden,
            eps=1e-6,
        ),
    ]
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("seq_starts", TensorProto.INT32, ["S1"]),
        helper.make_tensor_value_info("lookback", TensorProto.INT32, ["S", n]),
        helper.make_tensor_value_info("rows_addr", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("scales_addr", TensorProto.INT64, [1]),
        *([helper.make_tensor_value_info("bad_rows_addr", TensorProto.INT64, [1])] if bad_rows_input else []),
        helper.make_tensor_value_info("hidden", TensorProto.BFLOAT16, ["T", hc, hidden]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([-1, cols * head_dim], dtype=np.int64), "flat_shape"),
        bf16_init("wkv", [cols * head_dim, (hc + 1) * hidden]),
        bf16_init("q_weight", [hc, hidden]),
        bf16_init("k_weight", [hc, hidden]),
    ]
    graph = helper.make_graph(
        nodes, "engram", inputs, [helper.make_tensor_value_info("out", TensorProto.BFLOAT16, ["T", hc, hidden])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("engram_trt", 1)])
    onnx.save(model, str(path))


@pytest.mark.parametrize(
    "bad_rows_input, rank",
    [(False, None), (True, None), (True, 1)],
    ids=["tables only", "with bad-row counter", "rank 1 of 2: its columns and row slice"],
)
def test_onnx_graph_with_the_three_plugins_builds_an_engine(
    trt, layout: EngramLayout, tmp_path: Path, bad_rows_input: bool, rank: int | None
) -> None:
    path = tmp_path / "engram.onnx"
    shard = None if rank is None else shard_columns(layout, rank, 2)
    _engram_graph(layout, path, bad_rows_input=bad_rows_input, shard=shard)
    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    trt_compat.parse_onnx_file(trt_compat.onnx_parser(network), path)

    plugin_layers = [
        network.get_layer(i)
        for i in range(network.num_layers)
        if network.get_layer(i).type == trt.module.LayerType.PLUGIN_V3
    ]
    assert sorted(layer.name for layer in plugin_layers) == ["gate", "gather", "hash"]
    for layer in plugin_layers:  # the nodes' plugin_namespace names the creators' namespace
        layer.__class__ = trt.module.IPluginV3Layer
        core = layer.plugin.get_capability_interface(trt.module.PluginCapabilityType.CORE)
        assert (core.plugin_namespace, core.plugin_version) == (NAMESPACE, "1")
    by_name = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    assert tuple(by_name["out"].shape)[1:] == (2, 128) and by_name["out"].dtype == trt.module.bfloat16
    (gather,) = [layer for layer in plugin_layers if layer.name == "gather"]
    cols = layout.n_hash_cols if shard is None else shard.num_cols  # rank 1 of 2: columns 4..8 of 8
    assert tuple(gather.get_output(0).shape) == (-1, cols, 64)

    config = plugin_builder_config(trt, builder, aliased=False)
    profile = builder.create_optimization_profile()
    n = layout.max_ngram_size - 1
    for name, lo, opt, hi in (
        ("ids", (1,), (64,), (512,)),
        ("seq_starts", (2,), (3,), (9,)),
        ("lookback", (1, n), (2, n), (8, n)),
        ("hidden", (1, 2, 128), (64, 2, 128), (512, 2, 128)),
        ("mask", (1,), (64,), (512,)),
    ):
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None and engine.nbytes > 10_000


def _attention_graph(path: Path, io: str = "bf16", H: int = 8, kvh: int = 2, hd: int = 64) -> None:
    """q, k, v, the two caches, token slots and positions -> EngramAttention -> the output
    and both caches (network outputs, as in the serving graph)."""
    import onnx
    from onnx import TensorProto, helper

    elem = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16, "fp32": TensorProto.FLOAT}[io]
    cache = ["slots", kvh, "max_len", hd]
    node = helper.make_node(
        "EngramAttention",
        ["q", "k", "v", "key_cache", "value_cache", "token_slot", "token_pos"],
        ["out", "key_cache_out", "value_cache_out"],
        name="attention",
        domain="engram_trt",
        plugin_version="1",
        plugin_namespace=NAMESPACE,
        num_heads=H,
        num_kv_heads=kvh,
        head_dim=hd,
        scale=hd**-0.5,
    )
    inputs = [
        helper.make_tensor_value_info("q", elem, ["T", H, hd]),
        helper.make_tensor_value_info("k", elem, ["T", kvh, hd]),
        helper.make_tensor_value_info("v", elem, ["T", kvh, hd]),
        helper.make_tensor_value_info("key_cache", elem, cache),
        helper.make_tensor_value_info("value_cache", elem, cache),
        helper.make_tensor_value_info("token_slot", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("token_pos", TensorProto.INT32, ["T"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", elem, ["T", H, hd]),
        helper.make_tensor_value_info("key_cache_out", elem, cache),
        helper.make_tensor_value_info("value_cache_out", elem, cache),
    ]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("engram_trt", 1)])
    onnx.save(model, str(path))


@pytest.mark.parametrize("io", ["bf16", "fp16", "fp32"])
def test_attention_graph_builds_only_with_aliased_caches(trt, tmp_path: Path, caplog, io: str) -> None:
    """EngramAttention declares its cache outputs aliases of its cache inputs: with the
    aliasing preview feature (what build_engine enables) the engine builds, the caches
    network inputs and outputs of q's type; without it the builder refuses the plugin."""
    path = tmp_path / "attention.onnx"
    H, kvh, hd, slots, max_len = 8, 2, 64, 4, 256
    _attention_graph(path, io, H, kvh, hd)
    want = {"bf16": trt.module.bfloat16, "fp16": trt.module.float16, "fp32": trt.module.float32}[io]
    engines = {}
    for aliased in (True, False):
        builder, network, layer = parse_plugin_graph(trt, path)
        assert [layer.get_output(k).dtype for k in range(3)] == [want] * 3
        assert tuple(layer.get_output(1).shape) == (-1, kvh, -1, hd)  # the caches' dims, symbolic in the graph
        config = plugin_builder_config(trt, builder, aliased)
        profile = builder.create_optimization_profile()
        for name, n in (("q", H), ("k", kvh), ("v", kvh)):
            profile.set_shape(name, (1, n, hd), (16, n, hd), (64, n, hd))
        for name in ("token_slot", "token_pos"):
            profile.set_shape(name, (1,), (16,), (64,))
        for name in ("key_cache", "value_cache"):
            profile.set_shape(name, *[(slots, kvh, max_len, hd)] * 3)
        config.add_optimization_profile(profile)
        caplog.clear()
        try:
            engines[aliased] = builder.build_serialized_network(network, config)
        except Exception:  # noqa: BLE001 - a flavour may raise instead of returning None
            engines[aliased] = None
    assert engines[True] is not None and engines[True].nbytes > 5_000
    assert engines[False] is None
    if trt.is_rtx:  # the reason as TensorRT-RTX 1.7.1 gives it
        assert (
            "Aliased I/O used by plugin attention but PreviewFeature::kALIASED_PLUGIN_IO_10_03 not enabled"
            in caplog.text
        )


def _gate_graph(path: Path, io: str, weights: str, kv_io: str | None = None, hc: int = 2, hidden: int = 128) -> None:
    """hidden, kv (io, or kv_io) -> EngramGate (q/k weights of `weights`) -> out (io)."""
    import onnx
    from onnx import TensorProto, helper

    elem = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16, "fp32": TensorProto.FLOAT}
    rng = np.random.default_rng(1)

    def init(name, shape, dtype):
        import torch

        t = torch.from_numpy((1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        t = t.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
        raw = t.view(torch.int16).numpy().tobytes() if dtype != "fp32" else t.numpy().tobytes()
        return helper.make_tensor(name, elem[dtype], shape, raw, raw=True)

    node = helper.make_node(
        "EngramGate",
        ["hidden", "kv", "q_weight", "k_weight", "mask"],
        ["out"],
        name="gate",
        domain="engram_trt",
        plugin_version="1",
        plugin_namespace=NAMESPACE,
        hc_mult=hc,
        hidden_size=hidden,
        eps=1e-6,
    )
    inputs = [
        helper.make_tensor_value_info("hidden", elem[io], ["T", hc, hidden]),
        helper.make_tensor_value_info("kv", elem[kv_io or io], ["T", (hc + 1) * hidden]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T"]),
    ]
    graph = helper.make_graph(
        [node],
        "gate",
        inputs,
        [helper.make_tensor_value_info("out", elem[io], ["T", hc, hidden])],
        [init("q_weight", [hc, hidden], weights), init("k_weight", [hc, hidden], weights)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("engram_trt", 1)])
    onnx.save(model, str(path))


def _build_gate(trt, path: Path, hc: int = 2, hidden: int = 128):
    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    trt_compat.parse_onnx_file(trt_compat.onnx_parser(network), path)
    config = plugin_builder_config(trt, builder, aliased=False)
    profile = builder.create_optimization_profile()
    for name, dims in (
        ("hidden", lambda t: (t, hc, hidden)),
        ("kv", lambda t: (t, (hc + 1) * hidden)),
        ("mask", lambda t: (t,)),
    ):
        profile.set_shape(name, dims(1), dims(64), dims(512))
    config.add_optimization_profile(profile)
    return network, builder.build_serialized_network(network, config)


@pytest.mark.parametrize(
    "io, weights",
    [("fp16", "fp16"), ("fp16", "fp32"), ("fp16", "bf16"), ("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")],
)
def test_gate_graph_of_each_io_dtype_builds_an_engine(trt, tmp_path: Path, io: str, weights: str) -> None:
    """The gate takes hidden / kv in bf16, fp16 or fp32 (weights bf16, fp32 or hidden's
    type); the output has hidden's type, so an fp16 graph needs no casts around it."""
    path = tmp_path / "gate.onnx"
    _gate_graph(path, io, weights)
    network, engine = _build_gate(trt, path)
    want = {"bf16": trt.module.bfloat16, "fp16": trt.module.float16, "fp32": trt.module.float32}[io]
    (layer,) = [
        network.get_layer(i)
        for i in range(network.num_layers)
        if network.get_layer(i).type == trt.module.LayerType.PLUGIN_V3
    ]
    assert layer.get_output(0).dtype == want
    assert engine is not None and engine.nbytes > 5_000


@pytest.mark.parametrize(
    "io, weights, kv_io, reason",
    [
        (
            "fp16",
            "fp16",
            "fp32",
            "hidden and kv must be both bfloat16, both float16 or both float32, got float16 and float32",
        ),
        (
            "fp32",
            "fp16",
            None,
            "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type (float32)",
        ),
        (
            "bf16",
            "fp16",
            None,
            "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type (bfloat16)",
        ),
    ],
)
def test_gate_graph_with_mixed_types_is_refused(
    trt, tmp_path: Path, capfd, io: str, weights: str, kv_io: str | None, reason: str
) -> None:
    """hidden and kv of different types, or fp16 weights with non-fp16 hidden: no engine,
    and the plugin's reason reaches the log."""
    path = tmp_path / "gate.onnx"
    _gate_graph(path, io, weights, kv_io=kv_io)
    try:
        _, engine = _build_gate(trt, path)
    except Exception:  # noqa: BLE001 - the parser or builder may raise instead of returning None
        engine = None
    assert engine is None
    err = capfd.readouterr()
    assert f"EngramGate: {reason}" in err.out + err.err


# --- field validation through the registry's creators (createPlugin needs no GPU) -------

# (plugin_fields and create_plugin: tests/helpers/plugins.py)


def _text(values) -> str:
    return ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))


def _hash_fields(layout: EngramLayout) -> dict[str, tuple[str, object]]:
    return {
        "n_layers": ("int32", layout.num_layers),
        "max_ngram_size": ("int32", layout.max_ngram_size),
        "n_heads": ("int32", layout.n_heads),
        "pad_id": ("int64", layout.pad_id),
        "compressed_vocab_size": ("int64", layout.compressed_vocab_size),
        "primes": ("text", _text(layout.primes)),
        "offsets": ("text", _text(layout.offsets)),
        "multipliers": ("text", _text(layout.multipliers)),
    }


GATHER_FIELDS = {
    "layer_index": ("int32", 1),
    "n_layers": ("int32", 2),
    "n_cols": ("int32", 8),
    "head_dim": ("int32", 64),
    "table_dtype": ("int32", 0),
    "quant_block": ("int32", 32),
    "num_rows": ("int64", 1000),
}
GATE_FIELDS = {"hc_mult": ("int32", 4), "hidden_size": ("int32", 64), "eps": ("float32", 1e-6)}
ATTENTION_FIELDS = {
    "num_heads": ("int32", 32),
    "num_kv_heads": ("int32", 8),
    "head_dim": ("int32", 128),
    "scale": ("float32", 128**-0.5),
}

# (plugin, fields changed, what the refusal must say). Each value would have been narrowed
# to int32 or accepted before: 2^32 + 4 became 4, "p0+p1" read as [p0, p1], "12-3" as [12, -3].
BAD_FIELDS = [
    ("EngramGate", {"hc_mult": ("int64", 2**32 + 4)}, "field 'hc_mult' = 4294967300 is outside [1, 65535]"),
    ("EngramGate", {"hc_mult": ("int32", 65536)}, "field 'hc_mult' = 65536 is outside [1, 65535]"),
    ("EngramGate", {"hidden_size": ("int64", 2**32 + 64)}, "field 'hidden_size' = 4294967360 is outside"),
    (
        "EngramGate",
        {"hc_mult": ("int32", 65535), "hidden_size": ("int32", 32768)},
        "(hc_mult + 1) * hidden_size = 2147483648 exceeds 2^31 - 1",
    ),
    ("EngramHash", {"n_heads": ("int64", 2**32 + 4)}, "field 'n_heads' = 4294967300 is outside [1, 512]"),
    ("EngramHash", {"n_layers": ("int64", 2**32 + 2)}, "field 'n_layers' = 4294967298 is outside"),
    ("EngramHash", {"max_ngram_size": ("int64", 2**32 + 3)}, "field 'max_ngram_size' = 4294967299 is outside [2, 16]"),
    ("EngramHash", {"n_heads": ("int32", 300)}, "n_layers * (max_ngram_size - 1) * n_heads = 1200 exceeds 512"),
    ("EngramHash", "primes:+", "field 'primes' holds text that is not a list of integers"),
    ("EngramHash", "offsets:-", "field 'offsets' holds text that is not a list of integers"),
    ("EngramHash", {"pad_id": ("text", "5x")}, "field 'pad_id' holds text that is not a list of integers"),
    ("EngramGather", {"n_cols": ("int64", 2**32 + 8)}, "field 'n_cols' = 4294967304 is outside"),
    ("EngramGather", {"layer_index": ("int64", 2**32 + 1)}, "field 'layer_index' = 4294967297 is outside"),
    ("EngramGather", {"head_dim": ("int64", 2**32 + 64)}, "field 'head_dim' = 4294967360 is outside"),
    ("EngramGather", {"table_dtype": ("int64", 2**32)}, "field 'table_dtype' = 4294967296 is outside [0, 3]"),
    ("EngramGather", {"num_rows": ("int64", 2**31)}, "num_rows must be in [1, 2^31 - 1]"),
    ("EngramGather", {"bad_rows_input": ("int32", 2)}, "field 'bad_rows_input' = 2 is outside [0, 1]"),
    ("EngramGather", {"column_begin": ("int32", -1)}, "column_begin must be in [0, n_cols 8), got -1"),
    ("EngramGather", {"column_begin": ("int32", 8)}, "column_begin must be in [0, n_cols 8), got 8"),
    ("EngramGather", {"column_begin": ("int64", 2**32 + 2)}, "field 'column_begin' = 4294967298 is outside"),
    ("EngramGather", {"column_end": ("int32", 9)}, "column_end must be in [column_begin + 1, n_cols] = [1, 8], got 9"),
    (
        "EngramGather",
        {"column_begin": ("int32", 3), "column_end": ("int32", 3)},
        "column_end must be in [column_begin + 1, n_cols] = [4, 8], got 3",
    ),
    (
        "EngramGather",
        {"column_begin": ("int32", 5), "column_end": ("int64", 2)},
        "column_end must be in [column_begin + 1, n_cols] = [6, 8], got 2",
    ),
    ("EngramGather", {"row_offset": ("int64", -1)}, "row_offset must be >= 0, got -1"),
    (
        "EngramGather",
        {"row_offset": ("int64", 2**31 - 1000)},
        "row_offset 2147482648 + num_rows 1000 exceeds 2^31 - 1 (row ids are int32)",
    ),
    ("EngramGather", {"row_offset": ("int64", 2**63 - 1)}, "row_offset 9223372036854775807 + num_rows 1000 exceeds"),
    ("EngramAttention", {"num_heads": ("int64", 2**32 + 32)}, "field 'num_heads' = 4294967328 is outside"),
    ("EngramAttention", {"num_kv_heads": ("int32", 0)}, "field 'num_kv_heads' = 0 is outside"),
    ("EngramAttention", {"num_kv_heads": ("int32", 12)}, "num_heads must be a positive multiple of num_kv_heads"),
    ("EngramAttention", {"head_dim": ("int32", 100)}, "head_dim must be a multiple of 8 in [8, 256] (got 100)"),
    ("EngramAttention", {"head_dim": ("int64", 2**32 + 128)}, "field 'head_dim' = 4294967424 is outside [8, 256]"),
    ("EngramAttention", {"scale": ("float32", 0.0)}, "scale must be finite and > 0"),
    ("EngramAttention", {"scale": ("float32", float("inf"))}, "scale must be finite and > 0"),
    (
        "EngramAttention",
        {"num_heads": ("int32", 65536 * 8), "num_kv_heads": ("int32", 65536)},
        "num_kv_heads * ceil(num_heads / num_kv_heads / 8) = 65536 exceeds 65535",
    ),
    ("EngramAttention", {"window": ("int32", 4)}, "unknown field(s) window for plugin EngramAttention"),
    # a field left out (None) or of the wrong kind
    ("EngramGate", {"eps": None}, "missing field 'eps'"),
    ("EngramGate", {"hc_mult": ("float32", 4.0)}, "field 'hc_mult' must be an integer"),
    ("EngramAttention", {"scale": ("int32", 1)}, "field 'scale' must be a float"),
    ("EngramGather", {"num_rows": None}, "missing field 'num_rows'"),
    ("EngramHash", {"multipliers": None}, "missing field 'multipliers'"),
    (
        "EngramHash",
        {"primes": ("float32", [2.0] * 16)},
        "field 'primes' must be integers (got PluginFieldType 1, length 16)",
    ),
]


@pytest.mark.parametrize("plugin,change,message", BAD_FIELDS, ids=[f"{p}-{m[:40]}" for p, _, m in BAD_FIELDS])
def test_creators_refuse_out_of_range_fields(trt, layout: EngramLayout, capfd, plugin, change, message) -> None:
    base = {
        "EngramGate": GATE_FIELDS,
        "EngramGather": GATHER_FIELDS,
        "EngramHash": _hash_fields(layout),
        "EngramAttention": ATTENTION_FIELDS,
    }[plugin]
    fields = dict(base)
    if isinstance(change, str):  # "<field>:<char>": the first separator of a text array replaced
        name, char = change.split(":")
        fields[name] = ("text", fields[name][1].replace(",", char, 1))
    else:
        fields.update(change)
        for name in [name for name, value in change.items() if value is None]:
            del fields[name]
    capfd.readouterr()
    assert create_plugin(trt, plugin, fields) is None
    assert message in capfd.readouterr().err


def test_creators_accept_the_edge_of_each_range(trt, layout: EngramLayout) -> None:
    # the controls of the test above: the same fields, in range, build a plugin
    assert create_plugin(trt, "EngramGate", GATE_FIELDS) is not None
    widest = {"hc_mult": ("int64", 65535), "hidden_size": ("int32", 8)}
    assert create_plugin(trt, "EngramGate", {**GATE_FIELDS, **widest}) is not None
    assert (
        create_plugin(trt, "EngramGate", {**GATE_FIELDS, "hidden_size": ("int32", 429_496_728)}) is not None
    )  # 5 D = 2^31 - 8
    assert create_plugin(trt, "EngramHash", _hash_fields(layout)) is not None
    spaced = {**_hash_fields(layout), "primes": ("text", _text(layout.primes).replace(",", ", "))}
    assert create_plugin(trt, "EngramHash", spaced) is not None
    assert create_plugin(trt, "EngramGather", GATHER_FIELDS) is not None
    assert create_plugin(trt, "EngramGather", {**GATHER_FIELDS, "num_rows": ("int64", 2**31 - 1)}) is not None
    bf16 = {"table_dtype": ("int64", 1), "quant_block": ("int32", 0)}  # quant_block is ignored for bf16
    assert create_plugin(trt, "EngramGather", {**GATHER_FIELDS, **bf16}) is not None
    assert create_plugin(trt, "EngramAttention", ATTENTION_FIELDS) is not None
    for edge in (
        {"head_dim": ("int64", 256)},
        {"head_dim": ("int32", 8)},
        {"num_kv_heads": ("int32", 1)},
        {"num_kv_heads": ("int32", 32)},
        {"num_heads": ("int32", 65535 * 8), "num_kv_heads": ("int32", 65535)},
    ):
        assert create_plugin(trt, "EngramAttention", {**ATTENTION_FIELDS, **edge}) is not None, edge
    for flag in (0, 1):  # the optional bad-row counter input
        assert create_plugin(trt, "EngramGather", {**GATHER_FIELDS, "bad_rows_input": ("int32", flag)}) is not None
    for share in (
        {"column_begin": ("int32", 7)},
        {"column_end": ("int32", 1)},  # the first and last column alone
        {"column_begin": ("int64", 2), "column_end": ("int64", 6), "row_offset": ("int32", 0)},
        {"row_offset": ("int64", 2**31 - 1 - 1000)},
    ):  # the slice ends at the last int32 row id
        assert create_plugin(trt, "EngramGather", {**GATHER_FIELDS, **share}) is not None, share


# --- prepared hash layout, bad-row counter: host-side ABI (no GPU) ---------------------


def test_prepared_hash_layout_is_made_once_and_validated(plugin_lib: Path, layout: EngramLayout) -> None:
    """hash_kernels.hash_packed prepares a layout once per EngramLayout (validated and laid out
    as the kernel's parameter, no GPU needed) and reuses it; a bad layout is refused at
    preparation with the library's reason."""
    import ctypes

    first = hash_kernels.prepared_layout(layout)
    assert hash_kernels.prepared_layout(layout) is first and first.handle.value
    assert hash_kernels.prepared_layout(first) is first
    other = EngramLayout(**layout.__dict__)  # equal content, another object: its own preparation
    assert hash_kernels.prepared_layout(other) is not first
    bad = EngramLayout(**{**layout.__dict__, "multipliers": layout.multipliers.copy()})
    bad.multipliers[0, 1] = -3
    with pytest.raises(
        EngramError,
        match=r"engram_hash_layout_create failed: engram_hash_layout_create: "
        r"multiplier\[1\] = -3 is not in",
    ):
        hash_kernels.PreparedHashLayout(bad)
    hash_kernels.library()
    lib = gather_kernels.library()
    assert lib.engram_hash_prepared(None, None, 4, None, 1, None, None, None) == 1
    assert lib.engram_last_error().decode() == "engram_hash_prepared: layout is NULL"
    # zero tokens: nothing to launch, so success without a GPU
    assert lib.engram_hash_prepared(first.handle, None, 0, None, 0, None, None, None) == 0
    # the 128-slot layout parameter of CUDA < 12.1 is not the limit of this build: 512 slots still prepare
    wide = EngramSpec(
        layer_ids=(0, 1, 2, 3),
        max_ngram_size=3,
        n_heads=64,
        vocab_size=1000,
        compressed_vocab_size=900,
        pad_token_id=0,
        head_dim=64,
    )
    assert hash_kernels.PreparedHashLayout(EngramLayout.from_spec(wide, pad_id=5)).handle.value
    handle = ctypes.c_void_p(1)
    assert lib.engram_hash_layout_create(None, None, None, 1, 3, 4, 0, 10, ctypes.byref(handle)) == 1
    assert handle.value is None  # no half-made layout on failure


def test_gather_refuses_a_misaligned_bad_row_counter(plugin_lib: Path) -> None:
    import ctypes

    lib = gather_kernels.library()
    p = ctypes.c_void_p(256)  # never read: the call fails on its arguments first
    status = lib.engram_gather(
        p, 1, 1, 1, p, p, 10, 64, gather_kernels.TABLE_FP8_E4M3, 32, p, ctypes.c_void_p(260), None
    )
    assert (status, lib.engram_last_error().decode()) == (
        1,
        "engram_gather: bad_rows must be an 8-byte aligned device pointer",
    )


def test_check_bad_rows_raises_one_line_and_resets() -> None:
    import torch

    counter = torch.zeros(1, dtype=torch.int64)  # a CPU stand-in: the check only reads and zeroes it
    gather_kernels.check_bad_rows(counter)  # 0: nothing to report
    counter += 7
    with pytest.raises(EngramError, match=r"^layer 1 gather: 7 row\(s\) read no table \(ids outside \[0, num_rows\)"):
        gather_kernels.check_bad_rows(counter, what="layer 1 gather")
    assert int(counter.item()) == 0
    counter += 2
    with pytest.raises(EngramError, match="2 row"):
        gather_kernels.check_bad_rows(counter, reset=False)
    assert int(counter.item()) == 2


def test_gather_binding_checks_the_bad_row_counter() -> None:
    import torch

    ids, table = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(10, 64, dtype=torch.uint8)
    with pytest.raises(EngramError, match="^ids must be a CUDA tensor"):  # the device check comes first
        gather_kernels.gather(
            ids, table, torch.zeros(10, 2, dtype=torch.uint8), bad_rows=torch.zeros(1, dtype=torch.int64)
        )


# --- the plugin harness without a GPU: the build phase reads no table -------------------

HARNESS = harness_path()


def _harness_scripts(*modules: str) -> list:
    return harness_scripts(HARNESS, *modules)


@pytest.fixture(scope="module")
def harness():
    """The GPU tests' binding of the harness (tests/gpu/helpers.py) that CMake builds beside the library
    with -DENGRAM_TRT_BUILD_HARNESS=ON (it drives creator -> plugin -> enqueue as TensorRT
    does, without TensorRT)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_verify.py runs these enqueues for real")
    (common,) = _harness_scripts("helpers")
    return common, common.Harness(HARNESS)


def test_build_phase_gather_enqueue_takes_the_no_read_path(harness) -> None:
    """With no GPU every enqueue fails, which shows which path it took: a plugin created in
    the build phase (and its attachToContext clone, which harness_run enqueues) only
    clears its output (cudaMemsetAsync) and never launches the gather on the made-up
    table addresses; a runtime-phase plugin launches the gather. Errors name file:line."""
    import torch

    common, h = harness
    fields = common.gather_fields(0, 2, 8, 64, 0, 32, 1000) + [
        ("bad_rows_input", common.PF_INT32, np.array([1], np.int32))
    ]
    ids = torch.zeros(4, 2, 8, dtype=torch.int32)
    garbage = [torch.tensor([0x5EAD_BEE0_0000 + 16 * i]) for i in range(3)]  # rows, scales, counter
    out = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    types = [common.DT["int32"]] + [common.DT["int64"]] * 3
    messages = {}
    for phase in (0, 1):
        plugin = h.create("EngramGather", fields, phase=phase)
        try:
            with pytest.raises(RuntimeError) as failure:
                h.run(plugin, [ids, *garbage], types, out, common.DT["bfloat16"], 0)
            messages[phase] = str(failure.value)
        finally:
            h.lib.harness_destroy(plugin)
    assert "cudaMemsetAsync(outputs[0], 0, bytes, stream) failed" in messages[0], messages[0]
    assert "engram_gather" not in messages[0].split("enqueue failed")[-1], messages[0]
    assert re.search(r"\(engramGatherPlugin\.cpp:\d+\)", messages[0]), messages[0]
    assert "engram_gather launch failed" in messages[1], messages[1]


@pytest.fixture(scope="module")
def attention_harness():
    """tests/gpu/test_attention.py's harness binding (any number of outputs,
    getAliasedInput) and its checks that need no GPU."""
    (check,) = _harness_scripts("test_attention")
    return check, check.Harness(HARNESS)


def test_attention_plugin_through_the_harness(attention_harness) -> None:
    """EngramAttention as TensorRT drives it, without TensorRT: its three output shapes and
    types, getAliasedInput (outputs 1 and 2 alias inputs 3 and 4, build capability v2), a
    serialize -> createPlugin(kRUNTIME) round trip and refused fields."""
    check, h = attention_harness
    results = check.check_plugin_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 6
    assert not results.failed(), results.failed()


def test_attention_enqueue_validates_then_launches(attention_harness) -> None:
    """With no GPU an enqueue fails at its first CUDA call, which shows how far it got: with
    the cache outputs aliased (the same buffers as the inputs) it passes every check and
    fails launching the KV write; with separate output buffers it first copies the caches
    over (the fallback when TensorRT does not alias); a wrong shape never reaches CUDA."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_attention.py runs these enqueues for real")
    check, h = attention_harness
    H, kvh, hd, slots, max_len, T = 8, 2, 64, 3, 16, 5
    q = torch.zeros(T, H, hd, dtype=torch.bfloat16)
    k, v = torch.zeros(T, kvh, hd, dtype=torch.bfloat16), torch.zeros(T, kvh, hd, dtype=torch.bfloat16)
    kc, vc = (torch.zeros(slots, kvh, max_len, hd, dtype=torch.bfloat16) for _ in range(2))
    slot, pos = torch.zeros(T, dtype=torch.int32), torch.arange(T, dtype=torch.int32)
    io, i32 = check.DT["bfloat16"], check.DT["int32"]
    types = [io] * 5 + [i32] * 2
    plugin = h.create("EngramAttention", check.attention_fields(H, kvh, hd, hd**-0.5))
    try:
        messages = []
        for outputs in ([q.clone(), kc, vc], [q.clone(), kc.clone(), vc.clone()]):
            with pytest.raises(RuntimeError) as failure:
                h.run_outputs(plugin, [q, k, v, kc, vc, slot, pos], types, outputs, [io] * 3, 0)
            messages.append(str(failure.value))
        for inputs in ([q, k[:, :1], v, kc, vc, slot, pos], [q, k, v, kc, vc, slot, pos[:4]]):
            with pytest.raises(RuntimeError) as failure:
                h.run_outputs(plugin, inputs, types, [q.clone(), kc, vc], [io] * 3, 0)
            messages.append(str(failure.value))
    finally:
        h.lib.harness_destroy(plugin)
    assert "engram_kv_cache_write launch failed" in messages[0], messages[0]
    # the aliasing base's copy
    copy = "copyUnlessAliased(outputs[state.output], inputs[state.input], bytes, stream) failed"
    assert copy in messages[1], messages[1]
    assert "configurePlugin failed: EngramAttention: k must be [T, 2, 64], got [-1, 1, 64]" in messages[2], messages[2]
    assert "enqueue failed" in messages[3] and "token_pos must be [5], got [4]" in messages[3], messages[3]
    assert not any("launch" in m or "copyUnlessAliased" in m for m in messages[2:]), messages[2:]


# --- a tensor-parallel rank's gather: its columns of its row slice ----------------------


def test_gather_ex_abi_checks_the_row_offset(plugin_lib: Path) -> None:
    """engram_gather_ex / engram_gather_indirect_ex take a row slice's first global row id:
    refused outside [0, 2^31 - 1] (ids are int32) and for the identity gather, on the host,
    one line naming the function; valid arguments with no token launch nothing."""
    import ctypes

    lib = gather_kernels.library()
    lib.engram_gather_indirect_ex.restype = ctypes.c_int
    i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.engram_gather_indirect_ex.argtypes = [vp, i64, i32, i64, vp, vp, i64, i64, i32, i32, i32, vp, vp, vp]
    p = ctypes.c_void_p(256)  # never read: the calls fail on their arguments first, or launch nothing

    def direct(row_offset: int, ids=p, T: int = 1) -> tuple[int, str]:
        status = lib.engram_gather_ex(
            ids, T, 4, 8, p, p, 100, row_offset, 64, gather_kernels.TABLE_FP8_E4M3, 32, p, None, None
        )
        return status, lib.engram_last_error().decode()

    def indirect(row_offset: int, ids=p, T: int = 1) -> tuple[int, str]:
        status = lib.engram_gather_indirect_ex(
            ids, T, 4, 8, p, p, 100, row_offset, 64, gather_kernels.TABLE_BF16, 32, p, None, None
        )
        return status, lib.engram_last_error().decode()

    for fn, call in (("engram_gather_ex", direct), ("engram_gather_indirect_ex", indirect)):
        assert call(-1) == (1, f"{fn}: row_offset must be in [0, 2^31 - 1] (row ids are int32), got -1")
        assert call(2**31) == (1, f"{fn}: row_offset must be in [0, 2^31 - 1] (row ids are int32), got 2147483648")
        assert call(5, ids=None) == (1, f"{fn}: the identity gather (ids NULL) takes no row_offset, got 5")
        assert call(2**31 - 1, T=0) == (0, "")  # the largest offset is valid; zero tokens launch nothing
        assert call(0, ids=None, T=0) == (0, "")
    # the other checks name the _ex function too
    status = lib.engram_gather_ex(
        p, 1, 4, 8, ctypes.c_void_p(264), p, 100, 7, 64, gather_kernels.TABLE_FP8_E4M3, 32, p, None, None
    )
    assert (status, lib.engram_last_error().decode()) == (
        1,
        "engram_gather_ex: table rows must be a 16-byte aligned pointer",
    )


def test_gather_part_abi_refusals(plugin_lib: Path) -> None:
    """engram_gather_part (a gather of part of the output, or on part of the GPU) refuses
    on the host, naming itself: no ids (the identity gather writes every row), a
    keep_outside other than 0 / 1, a negative max_blocks; then engram_gather_ex's own
    checks under its name; valid arguments with no token launch nothing."""
    import ctypes

    lib = gather_kernels.library()
    p = ctypes.c_void_p(256)  # never read: the calls fail on their arguments first, or launch nothing

    def part(ids=p, keep: int = 1, blocks: int = 0, T: int = 1, rows=p, offset: int = 0) -> tuple[int, str]:
        status = lib.engram_gather_part(
            ids, T, 4, 8, rows, p, 100, offset, 64, gather_kernels.TABLE_FP8_E4M3, 32, keep, blocks, p, None
        )
        return status, lib.engram_last_error().decode()

    fn = "engram_gather_part"
    assert part(ids=None) == (1, f"{fn}: ids are required (the identity gather writes every row: use engram_gather)")
    assert part(keep=2) == (1, f"{fn}: keep_outside must be 0 or 1, got 2")
    assert part(blocks=-1) == (1, f"{fn}: max_blocks must be >= 0 (0: one full wave), got -1")
    assert part(offset=-1) == (1, f"{fn}: row_offset must be in [0, 2^31 - 1] (row ids are int32), got -1")
    assert part(rows=ctypes.c_void_p(264)) == (1, f"{fn}: table rows must be a 16-byte aligned pointer")
    assert part(T=0, keep=0, blocks=3) == (0, "") and part(T=0) == (0, "")


def test_gather_raw_abi_refusals(plugin_lib: Path) -> None:
    """engram_gather_raw (raw rows, no dequant, e.g. a cache's misses through UVA) names
    a bad count, row width, grid cap or missing pointer on the host; 0 rows launch
    nothing, with no pointer read."""
    import ctypes

    lib = gather_kernels.library()
    p, q = ctypes.c_void_p(256), ctypes.c_void_p(264)

    def raw(
        count: int = 3,
        rows=p,
        row_bytes: int = 256,
        scale_bytes: int = 8,
        scales=p,
        dst=p,
        dst_scales=p,
        blocks: int = 0,
        ids=p,
    ) -> tuple[int, str]:
        status = lib.engram_gather_raw(
            ids, count, rows, scales, 100, row_bytes, scale_bytes, dst, dst_scales, blocks, None
        )
        return status, lib.engram_last_error().decode()

    fn = "engram_gather_raw"
    shape = (
        f"{fn}: need count >= 0, table_num_rows >= 0, row_bytes a positive multiple of 16, scale_bytes >= 0, "
        f"max_blocks >= 0"
    )
    assert raw(count=-1) == (1, f"{shape} (got -1, 100, 256, 8, 0)")
    assert raw(row_bytes=264) == (1, f"{shape} (got 3, 100, 264, 8, 0)")
    assert raw(blocks=-2) == (1, f"{shape} (got 3, 100, 256, 8, -2)")
    need = f"{fn}: ids (4-byte aligned) and the table's and dst's rows (16-byte aligned) are required"
    assert raw(ids=None) == (1, need) and raw(rows=q) == (1, need) and raw(dst=None) == (1, need)
    assert raw(scales=None) == (1, f"{fn}: scale_bytes 8 needs table_scales and dst_scales")
    assert raw(count=0, ids=None, rows=None, dst=None) == (0, "")


def test_gather_binding_refuses_partial_gathers_it_cannot_honour() -> None:
    """gather_kernels.gather(keep_outside=, max_blocks=) name what is wrong before any device
    check: keep_outside without the out it leaves rows in, a bad grid cap, a bad-row
    counter (engram_gather_part counts nothing)."""
    import torch

    ids, table = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(10, 64, dtype=torch.bfloat16)
    with pytest.raises(EngramError, match="^keep_outside leaves rows of out as they are: pass the out tensor"):
        gather_kernels.gather(ids, table, keep_outside=True)
    for blocks in (-1, 1.5, None):
        with pytest.raises(EngramError, match=r"^max_blocks must be an integer >= 0 \(0: one full wave of blocks\)"):
            gather_kernels.gather(ids, table, max_blocks=blocks)
    with pytest.raises(EngramError, match="^keep_outside / max_blocks count no bad rows: pass bad_rows=None"):
        gather_kernels.gather(ids, table, max_blocks=4, bad_rows=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(EngramError, match="^ids must be a CUDA tensor"):  # valid: on to the device check
        gather_kernels.gather(
            ids, table, keep_outside=True, out=torch.empty(2, 3, 64, dtype=torch.bfloat16), max_blocks=2
        )


def test_cache_overlap_abi(plugin_lib: Path) -> None:
    """engram_cache_overlap_create needs its output; destroying NULL is a no-op; on a
    machine without a usable GPU creation fails with the CUDA reason, leaving NULL."""
    import ctypes

    from engram_trt.native import cache as cache_kernels

    lib = cache_kernels.library()
    assert lib.engram_cache_overlap_create(None) == 1
    assert lib.engram_last_error().decode() == "engram_cache_overlap_create: overlap (the output) is required"
    assert lib.engram_cache_overlap_destroy(None) == 0
    handle = ctypes.c_void_p(1234)
    status = lib.engram_cache_overlap_create(ctypes.byref(handle))
    if status == 0:  # a GPU is here: a real overlap, released again
        assert handle.value and lib.engram_cache_overlap_destroy(handle) == 0
    else:
        assert handle.value is None
        assert (
            lib.engram_last_error()
            .decode()
            .startswith("engram_cache_overlap_create: creating its stream and event failed (cacheStep.cpp:")
        )


def test_gather_binding_checks_the_column_range_and_row_offset() -> None:
    """gather_kernels.gather(columns=, row_offset=) name a bad range or offset before any device
    check (so they fail the same with or without a GPU)."""
    import torch

    ids, table = torch.zeros(2, 3, 8, dtype=torch.int32), torch.zeros(10, 64, dtype=torch.bfloat16)
    for columns in ((3, 3), (-1, 4), (2, 9), (5, 2), (1,), "0:4", (0.0, 4), (True, 4)):
        with pytest.raises(
            EngramError,
            match=r"^columns must be \(begin, end\) with 0 <= begin < end <= 8 \(the ids' "
            r"columns\); got ",
        ):
            gather_kernels.gather(ids, table, layer=1, columns=columns)
    for row_offset in (-1, 2**31, 1.0, True, None):
        with pytest.raises(EngramError, match=r"^row_offset must be an integer in \[0, 2\^31 - 1\] .*; got "):
            gather_kernels.gather(ids, table, layer=1, row_offset=row_offset)
    with pytest.raises(EngramError, match="^ids must be a CUDA tensor"):  # a valid share: on to the device check
        gather_kernels.gather(ids, table, layer=1, columns=(0, 8), row_offset=2**31 - 1)
    assert gather_kernels.ids_view(ids, 1, "any", (5, 8)) == (2, 3, 24, (8 + 5) * 4)  # [T, 3 columns], stride L * cols
    assert gather_kernels.ids_view(ids[:, 0].contiguous(), None, "any", (0, 8)) == (2, 8, 8, 0)


@pytest.fixture(scope="module")
def column_range_check():
    """tests/gpu/test_column_range.py and the harness (creation, shapes, serialized fields:
    no GPU needed)."""
    check, common = _harness_scripts("test_column_range", "helpers")
    return check, common, common.Harness(HARNESS)


def test_column_range_fields_through_the_harness(column_range_check) -> None:
    """EngramGather's column_begin / column_end / row_offset as TensorRT drives them: the
    output shape [T, column_end - column_begin, head_dim], the values getFieldsToSerialize
    writes into an engine before and after a round trip, the defaults (every column of the
    whole table) and the refusals (one line, the field named, file:line)."""
    check, _common, h = column_range_check
    results = check.check_column_range_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 11
    assert not results.failed(), results.failed()


def test_rank_share_gather_enqueue_validates_then_launches(column_range_check) -> None:
    """With no GPU an enqueue fails at its first CUDA call, which shows how far it got: a
    rank's plugin (columns 2..5 of 8, a row slice at global row 700) given a [T, 3,
    head_dim] output passes every check of the plugin and of engram_gather_indirect_ex
    (the row offset included) and fails launching the gather; given the full [T, 8,
    head_dim] output it is refused before any CUDA call; its build-phase twin only clears
    the output."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_column_range.py runs these enqueues for real")
    _, common, h = column_range_check
    fields = (
        common.gather_fields(1, 2, 8, 64, 0, 32, 300)
        + common.column_range_fields(2, 5, 700)
        + [("bad_rows_input", common.PF_INT32, np.array([1], np.int32))]
    )
    ids = torch.zeros(4, 2, 8, dtype=torch.int32)
    addresses = [torch.tensor([0x5EAD_BEE0_0000 + 16 * i]) for i in range(3)]  # rows, scales, counter
    types = [common.DT["int32"]] + [common.DT["int64"]] * 3
    messages = []
    for phase, width in ((1, 3), (1, 8), (0, 3)):
        plugin = h.create("EngramGather", fields, phase=phase)
        try:
            with pytest.raises(RuntimeError) as failure:
                h.run(
                    plugin,
                    [ids, *addresses],
                    types,
                    torch.zeros(4, width, 64, dtype=torch.bfloat16),
                    common.DT["bfloat16"],
                    0,
                )
            messages.append(str(failure.value))
        finally:
            h.lib.harness_destroy(plugin)
    assert "engram_gather launch failed" in messages[0], messages[0]
    assert "output must be [T, 3, 64], got [4, 8, 64]" in messages[1], messages[1]
    assert re.search(r"\(engramGatherPlugin\.cpp:\d+\)", messages[1]) and "launch" not in messages[1], messages[1]
    assert "cudaMemsetAsync(outputs[0], 0, bytes, stream) failed" in messages[2], messages[2]
