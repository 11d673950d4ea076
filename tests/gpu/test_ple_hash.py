"""The PLE hash kernel (plugins/kernels/pleHashKernel.cu) on a GPU against the Python
reference, engram_trt.engram.ple_hash (itself tied to transformers' Qwen4-Exp module in
tests/engram/test_ple_hash.py): random packed steps with EOS runs (alone, consecutive, at a
sequence's start and end, in the contexts), empty sequences, fresh and carried contexts,
context=None, and the default config's layers (base 20,000,000, 16 heads). Bit-exact;
the output is poisoned first. The EngramPleHash plugin's enqueue (plugins/engramPleHashPlugin,
through the plugin harness: the build-phase plugin and its serialized runtime twin, int64
and decimal-text fields) on the same steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from .helpers import DT, PF_CHAR, PF_INT32, PF_INT64, say

CONFIGS = [  # (vocab, ngram_size, heads_per_ngram, base, divisor, seed, eos, num_layers)
    (97, 2, 1, 50, 16, 1234, 96, 3),
    (1000, 3, 2, 200, 128, -3, 0, 4),
    (300, 4, 3, 1000, 7, 99, 151, 3),
    (248_320, 3, 8, 20_000_000, 128, 1234, 248_044, 40),
    (50_000, 16, 8, 1_000_000, 128, 5, 7, 2),  # the kernel's limits: N = 16, H = 120
]


def make_layout(cfg):
    from engram_trt.engram.ple_hash import PLEHashLayout

    vocab, n, hpn, base, div, seed, eos, L = cfg
    return PLEHashLayout.from_config(
        vocab_size=vocab,
        ngram_size=n,
        heads_per_ngram=hpn,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=div,
        seed=seed,
        eos_token_id=eos,
        num_layers=L,
    )


def random_step(rng, layout, num_seqs: int, max_len: int, eos_frac: float = 0.08):
    """Packed ids with EOS runs and empty sequences; contexts: fresh (all EOS), random,
    or random with EOS inside."""
    lengths = rng.integers(0, max_len + 1, size=num_seqs)
    lengths[rng.random(num_seqs) < 0.1] = 0
    T = int(lengths.sum())
    ids = rng.integers(0, layout.vocab_size, size=T, dtype=np.int64)
    for _ in range(max(1, int(T * eos_frac / 2))):
        if T:
            at = int(rng.integers(0, T))
            ids[at : at + int(rng.integers(1, 4))] = layout.eos_id
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    starts[1:] = np.cumsum(lengths)
    ids[starts[:-1][lengths > 0][rng.random(int((lengths > 0).sum())) < 0.2]] = layout.eos_id  # EOS first
    n = layout.ngram_size - 1
    context = rng.integers(0, layout.vocab_size, size=(num_seqs, n), dtype=np.int64)
    context[rng.random(num_seqs) < 0.3] = layout.eos_id
    context[rng.random((num_seqs, n)) < 0.15] = layout.eos_id
    return ids, starts, context


@pytest.mark.parametrize("which", ["first", "last"])  # the layout's first and last PLE layer
@pytest.mark.parametrize("num_seqs,max_len", [(1, 1), (7, 40), (300, 400)])
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_kernel_ple_hash(rng, ci, num_seqs, max_len, which) -> None:
    import torch

    from engram_trt.engram import ple_hash as ph
    from engram_trt.native import library as kernel_library
    from engram_trt.native import ple as native_ple

    dev = torch.device("cuda")
    say(f"library {kernel_library.library_path()} version {kernel_library.version()}")
    layout = make_layout(CONFIGS[ci])
    li = 0 if which == "first" else layout.num_layers - 1
    ids, starts, context = random_step(rng, layout, num_seqs, max_len)
    ids_d = torch.from_numpy(ids.astype(np.int32)).to(dev)
    starts_d = torch.from_numpy(starts.astype(np.int32)).to(dev)
    ctx_d = torch.from_numpy(context.astype(np.int32)).to(dev)
    ref = ph.ple_hash_packed(ids, starts, context, layout, li)
    out = torch.full((ids.shape[0], layout.num_heads), -12345, dtype=torch.int32, device=dev)
    native_ple.ple_hash_packed(ids_d, starts_d, ctx_d, layout, li, out=out)
    got = out.cpu().numpy().astype(np.int64)
    assert np.array_equal(got, ref), (
        f"ple hash config{ci} layer {li} S={num_seqs} T={ids.shape[0]}: "
        f"{int((got != ref).sum())} of {ref.size} ids differ"
    )


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_kernel_ple_hash_fresh_context(rng, ci) -> None:
    """context=None: every sequence fresh (the EOS-filled context)."""
    import torch

    from engram_trt.engram import ple_hash as ph
    from engram_trt.native import ple as native_ple

    dev = torch.device("cuda")
    layout = make_layout(CONFIGS[ci])
    last = layout.num_layers - 1
    ids, starts, _ = random_step(rng, layout, 5, 30)
    ref = ph.ple_hash_packed(ids, starts, ph.fresh_context(5, layout), layout, last)
    got = native_ple.ple_hash_packed(
        torch.from_numpy(ids.astype(np.int32)).to(dev),
        torch.from_numpy(starts.astype(np.int32)).to(dev),
        None,
        layout,
        last,
    )
    assert np.array_equal(got.cpu().numpy(), ref), f"ple hash config{ci} context None = fresh"


def test_kernel_ple_hash_chunked(rng) -> None:
    """A prefill cut into chunks and decode steps, the contexts carried on the host by
    next_context: the kernel's steps concatenated equal the whole sequence's reference."""
    import torch

    from engram_trt.engram import ple_hash as ph
    from engram_trt.native import ple as native_ple

    dev = torch.device("cuda")
    layout = make_layout(CONFIGS[2])
    seq = rng.integers(0, layout.vocab_size, size=60, dtype=np.int64)
    seq[[0, 9, 10, 11, 30, 59]] = layout.eos_id
    whole = ph.ple_hash_packed(seq, [0, 60], ph.fresh_context(1, layout), layout, 1)
    cuts = [0, 10, 12, 31] + list(range(32, 61))
    ctx = ph.fresh_context(1, layout)
    pieces = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        part = seq[a:b]
        got = native_ple.ple_hash_packed(
            torch.from_numpy(part.astype(np.int32)).to(dev),
            torch.tensor([0, b - a], dtype=torch.int32, device=dev),
            torch.from_numpy(ctx.astype(np.int32)).to(dev),
            layout,
            1,
        )
        pieces.append(got.cpu().numpy())
        ctx = ph.next_context(ctx, part, [0, b - a])
    got = np.concatenate(pieces)
    assert np.array_equal(got, whole), (
        f"ple hash chunks + decode steps = whole: {int((got != whole).sum())} of {whole.size} ids differ"
    )


def ple_plugin_fields(layout, layer: int, text: bool = False):
    """EngramPleHash's fields for one PLE layer: int64 arrays, or decimal text (the ONNX form)."""

    def array(values):
        values = np.ascontiguousarray(values, np.int64)
        if not text:
            return PF_INT64, values
        return PF_CHAR, np.frombuffer(",".join(str(int(v)) for v in values).encode(), np.uint8)

    return [
        ("ngram_size", PF_INT32, np.array([layout.ngram_size], np.int32)),
        ("heads_per_ngram", PF_INT32, np.array([layout.heads_per_ngram], np.int32)),
        ("eos_id", PF_INT64, np.array([layout.eos_id], np.int64)),
        ("vocab_size", PF_INT64, np.array([layout.vocab_size], np.int64)),
        ("table_rows", PF_INT64, np.array([layout.table_rows[layer]], np.int64)),
        ("multipliers", *array(layout.multipliers[layer])),
        ("primes", *array(layout.head_vocab_sizes[layer])),
        ("offsets", *array(layout.head_offsets[layer])),
    ]


@pytest.mark.parametrize("form", ["int64", "text"])
@pytest.mark.parametrize("num_seqs,max_len", [(1, 1), (9, 50), (200, 300)])
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_plugin_ple_hash_enqueue(rng, harness, ci, num_seqs, max_len, form) -> None:
    """EngramPleHash's enqueue equals the reference on random packed steps with EOS runs,
    the build-phase plugin and its round-tripped runtime twin alike, from int64 and
    text fields; the output is poisoned first."""
    import torch

    from engram_trt.engram import ple_hash as ph

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    layout = make_layout(CONFIGS[ci])
    layer = layout.num_layers - 1
    ids, starts, context = random_step(rng, layout, num_seqs, max_len)
    ref = ph.ple_hash_packed(ids, starts, context, layout, layer)
    inputs = [torch.from_numpy(a.astype(np.int32)).to(dev) for a in (ids, starts, context)]
    h = harness.create("EngramPleHash", ple_plugin_fields(layout, layer, form == "text"), phase=0)
    h2 = harness.roundtrip(h)
    same, ws = [], set()
    for handle in (h, h2):  # the build-phase plugin and its runtime twin, asserted together
        out = torch.full((ids.shape[0], layout.num_heads), -777, dtype=torch.int32, device=dev)
        ws.add(harness.run(handle, inputs, [DT["int32"]] * 3, out, DT["int32"], stream))
        torch.cuda.synchronize()
        same.append(np.array_equal(out.cpu().numpy().astype(np.int64), ref))
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    assert all(same) and ws == {0}, (
        f"plugin EngramPleHash enqueue config{ci} layer {layer} S={num_seqs} T={ids.shape[0]} ({form}): "
        f"build / runtime equal: {same}, workspace {sorted(ws)}"
    )
