"""The fused decoder-layer path of the torch backend on a GPU (formerly
scripts/h200_backbone_check.py and h200_backbone_model.py; its timing is
``benchmarks/kernels/bench_backbone.py``).

One script, one device call:
  1. build      cmake (sm_90 by default), unless --skip-build.
  2. abi        the new entry points' argument checks (engram_hc_rms_norm, engram_silu_mul,
                engram_rope_kv_cache_write): refused on the host with one-line reasons,
                zero tokens launch nothing. Needs no GPU (also under --cpu-only).
  3. reference  the PyTorch ops the kernels reproduce (reference.kernel_ops.TorchBackboneOps,
                bf16 on the CPU) against the float64 references below, within the bounds
                below: the bounds are those of the reference itself. Needs no GPU.
  4. kernels    each kernel against a float64 torch reference (bounds below) and against
                the PyTorch bf16 ops it replaces (<= 1 bf16 ulp apart, <= 1% of elements
                differing; the residual update and the V copy bit for bit): T in 1, 64,
                256, 8192; hc 1, 3, 4; D 2048, 4096 and odd sizes (3, 1000, 2047, 16384),
                a misaligned tensor (the element-load path); RoPE heads 16/8/128, 32/8/128,
                4/4/64, 16/8/256 and head dims 40 and 8 (the 4-vector path), random distinct
                (slot, position) cells with out-of-cache tokens (nothing written, the rest
                of the cache untouched bit for bit); all three captured in one CUDA graph
                and replayed with new data, positions and slots.
  5. model      the 1.15B engram-llama of ``engram-trt bench step --model 1b`` (Engram on
                layers 1 and 2, tables in GPU memory): the fused path (eager, and decode
                steps replayed as the runtime's DecodeGraphs) against the unfused path and
                a float32 twin, on a packed prefill of four sequences and three decode steps.
  6. timing     decode steps of 1, 64 and 256 sequences (context 256, the Engram layers
                removed: the backbone the target is about) replayed as DecodeGraphs, fused
                vs unfused in the same run, each as a ratio to the step's weight-read bound
                (backbone weights + the K/V read, at the HBM copy rate measured now), with
                the kernels one replay launches.
Writes $OUT/h200_backbone_check.json and .log; prints a summary table last; exits 1 on
a failed check.

Bounds against float64 on the same (bf16) inputs, elementwise, u = 2^-8 (bf16 rounding):
  norm   |out - ref| <= 3u (1 + 2u) |ref| + 2^-20 max|ref|: the bf16 mean (u) moves each
         element and the RMS by <= u each, the output rounding adds u; float32 sums and
         rsqrtf stay near 1e-6 (the 2^-20 terms).
  rope   |out - ref| <= (2u (1 + u) + 2^-20) (|x cos| + |rotate_half(x) sin|): two rounded
         products (exact in float32 before rounding) and a rounded sum (float32, then bf16).
  silu   |out - ref| <= (2u (1 + u) + 2^-20) |ref| + 1e-30: silu rounded, then the rounded
         product (float32 expf and division: a few float32 ulps).
  model  rel L2 of the logits vs the float32 twin <= 1.5 x the unfused bf16 path's + 2e-3
         (the same bf16 weights: the fused path may not be less accurate than the unfused).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest

from .cases import MODEL_OPTIONS, build_model, decode_case, decode_step, decode_variants, rel_err, variant_settings

from .helpers import U, combined, note, say, ulp_distance, versus_torch, within  # noqa: F401

EPS = 1e-6
ROPE_THETA = 10000.0


def placed(t, misaligned: bool):
    """A contiguous copy of t, starting 2 bytes past a 16-byte boundary when misaligned."""
    import torch

    if not misaligned:
        return t.clone()
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


# --- float64 references and the PyTorch ops ------------------------------------------------------


def norm_module(weight, eps: float):
    """The model's RMSNorm holding ``weight``."""
    import torch

    from engram_trt.models.engram_llama.modules import RMSNorm

    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    return norm


def norm_inputs(gen, device, T: int, hc: int, D: int, residual: bool) -> dict:
    import torch

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    hs = randn(T, hc, D)
    r = randn(T, D) if residual else None
    if T > 2:
        hs[1] = 0  # an all-zero token: its norm is eps alone
        if r is not None:
            r[1] = 0
    return {
        "hs": hs,
        "residual": r,
        "weight": (1 + 0.1 * torch.randn(D, generator=gen, device=device)).to(torch.bfloat16),
    }


def norm_verify(inputs: dict, got_out, got_hs) -> tuple[bool, str]:
    """The kernel's out and hs (after its in-place residual update) against the PyTorch
    ops on the same inputs and against float64: (ok, detail)."""
    import torch

    from engram_trt.models.engram_llama.kernel_ops import TorchBackboneOps

    hs_t = inputs["hs"].clone()
    want = TorchBackboneOps().norm(hs_t, inputs["residual"], norm_module(inputs["weight"], EPS))
    m = hs_t.double().mean(dim=1)
    ref = m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + EPS) * inputs["weight"].double()
    bound = 3 * U * (1 + 2 * U) * ref.abs() + 2.0**-20 * float(ref.abs().max())
    parts = [versus_torch(got_out, want), within(got_out, ref, bound)]
    if inputs["residual"] is not None:
        ok, detail = versus_torch(got_hs, hs_t, exact=True)
        parts.append((ok, "residual update " + detail.replace("vs torch ops: ", "")))
    return combined(*parts)


def rope_inputs(
    gen, device, T: int, H: int, kvh: int, hd: int, num_slots: int, max_len: int, out_of_cache: bool = True
) -> dict:
    import torch

    qkv = torch.randn(T, (H + 2 * kvh) * hd, generator=gen, device=device).to(torch.bfloat16)
    assert T <= num_slots * max_len
    cells = torch.randperm(num_slots * max_len, generator=gen, device=device)[:T]  # distinct (slot, position)
    slots, pos = cells // max_len, cells % max_len
    if out_of_cache and T >= 4:
        bad = torch.randperm(T, generator=gen, device=device)[: max(1, T // 16)]
        for i, t in enumerate(bad.tolist()):
            if i % 4 == 0:
                slots[t] = -1
            elif i % 4 == 1:
                slots[t] = num_slots
            elif i % 4 == 2:
                pos[t] = max_len
            else:
                pos[t] = -1
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    freqs = pos.clamp_min(0).to(torch.float32)[:, None] * inv_freq[None, :]  # the model's cos / sin
    emb = torch.cat((freqs, freqs), dim=-1)
    shape = (num_slots, kvh, max_len, hd)
    return {
        "qkv": qkv,
        "cos": emb.cos().to(torch.bfloat16),
        "sin": emb.sin().to(torch.bfloat16),
        "slots": slots.to(torch.int32),
        "pos": pos.to(torch.int32),
        "H": H,
        "kvh": kvh,
        "hd": hd,
        "keys": torch.randn(shape, generator=gen, device=device).to(torch.bfloat16),
        "values": torch.randn(shape, generator=gen, device=device).to(torch.bfloat16),
    }


def rope_verify(inputs: dict, got_q, got_keys, got_values) -> tuple[bool, str]:
    """q and the caches against the PyTorch ops (written cells within 1 ulp, every other
    cell and the V copy bit for bit) and against float64."""
    import torch

    from engram_trt.models.engram_llama.modules import rotate_half

    H, kvh, hd = inputs["H"], inputs["kvh"], inputs["hd"]
    qkv, cos, sin = inputs["qkv"], inputs["cos"][:, None, :], inputs["sin"][:, None, :]
    T = qkv.shape[0]
    num_slots, _, max_len, _ = inputs["keys"].shape
    q, k, v = (x.reshape(T, -1, hd) for x in qkv.split([H * hd, kvh * hd, kvh * hd], dim=-1))
    q_t = q * cos + rotate_half(q) * sin
    k_t = k * cos + rotate_half(k) * sin
    slots, pos = inputs["slots"].long(), inputs["pos"].long()
    valid = (slots >= 0) & (slots < num_slots) & (pos >= 0) & (pos < max_len)
    keys_t, values_t = inputs["keys"].clone(), inputs["values"].clone()
    keys_t[slots[valid], :, pos[valid]] = k_t[valid]
    values_t[slots[valid], :, pos[valid]] = v[valid]
    written = torch.zeros(num_slots, max_len, dtype=torch.bool, device=qkv.device)
    written[slots[valid], pos[valid]] = True
    written = written[:, None, :, None].expand_as(keys_t)
    d = ulp_distance(got_keys, keys_t)
    untouched = int(d[~written].max()) if (~written).any() else 0
    kv_ok = untouched == 0 and (int(d[written].max()) <= 1 if written.any() else True)
    v_ok, v_detail = versus_torch(got_values, values_t, exact=True)

    def ref64(x, c, s):
        x, c, s = x.double(), c.double(), s.double()
        return x * c + rotate_half(x) * s, (2 * U * (1 + U) + 2.0**-20) * ((x * c).abs() + (rotate_half(x) * s).abs())

    q_ref, q_bound = ref64(q, cos, sin)
    # cos/sin are per token ([T, 1, hd]): the tokens inside the cache take their own rows
    k_ref, k_bound = ref64(k[valid], cos[valid], sin[valid])
    k_got = got_keys[slots[valid], :, pos[valid]]
    return combined(
        versus_torch(got_q, q_t),
        within(got_q, q_ref, q_bound),
        (
            kv_ok,
            f"keys: written cells max {int(d[written].max()) if written.any() else 0} ulp from torch, "
            f"others max {untouched} ulp (must be 0), {int((~valid).sum())} tokens outside the cache",
        ),
        (v_ok, "values " + v_detail.replace("vs torch ops: ", "")),
        within(k_got, k_ref, k_bound),
    )


def silu_inputs(gen, device, T: int, I: int) -> dict:
    import torch

    gu = torch.randn(T, 2 * I, generator=gen, device=device) * 2
    if T * I > 8:
        flat = gu.view(-1)
        flat[:6] = torch.tensor([80.0, -80.0, 1e4, -1e4, 0.0, -0.0], device=device)  # saturated and zero gates
    return {"gate_up": gu.to(torch.bfloat16)}


def silu_verify(inputs: dict, got) -> tuple[bool, str]:
    from engram_trt.models.engram_llama.kernel_ops import TorchBackboneOps

    gu = inputs["gate_up"]
    want = TorchBackboneOps().silu_mul(gu)
    g, u = gu.double().chunk(2, dim=-1)
    ref = g / (1 + (-g).exp()) * u
    return combined(versus_torch(got, want), within(got, ref, (2 * U * (1 + U) + 2.0**-20) * ref.abs() + 1e-30))


# --- 2. ABI (no GPU) -------------------------------------------------------------------------------

_P = ctypes.c_void_p(16)  # never read: every call below fails on its arguments first (or launches nothing)
_OUT = ctypes.c_void_p(1 << 40)


def backbone_abi(entry: str, **args) -> tuple[int, str]:
    """One of the three entry points (``norm``, ``silu``, ``rope``) called with the
    arguments of a good call but ``args``: (status, its last error)."""
    from engram_trt.native import attention as attention_kernels
    from engram_trt.native import backbone as backbone_kernels

    lib = backbone_kernels.library()
    attention_kernels.library()

    def norm(hs=_P, residual=None, weight=_P, T=4, hc=4, D=2048, eps=1e-6, out=_OUT):
        return lib.engram_hc_rms_norm(hs, residual, weight, T, hc, D, ctypes.c_float(eps), out, None)

    def silu(gu=_P, T=4, I=5632, out=_OUT):
        return lib.engram_silu_mul(gu, T, I, out, None)

    def rope(T=4, H=16, kvh=8, hd=128, slot=_P, q_out=_OUT):
        return lib.engram_rope_kv_cache_write(_P, _P, _P, slot, _P, T, H, kvh, hd, _P, _P, 4, 256, q_out, None)

    status = {"norm": norm, "silu": silu, "rope": rope}[entry](**args)
    return status, lib.engram_last_error().decode()


# (name, entry point, the arguments that differ from a good call, (status, last error) wanted):
# the entry points refuse bad arguments on the host before any CUDA call.
ABI_CASES = [
    (
        "norm: hc_mult 0",
        "norm",
        {"hc": 0},
        (1, "engram_hc_rms_norm: need hc_mult >= 1 and 1 <= hidden_size <= 16384 (got 0, 2048)"),
    ),
    (
        "norm: hidden 16385",
        "norm",
        {"D": 16385},
        (1, "engram_hc_rms_norm: need hc_mult >= 1 and 1 <= hidden_size <= 16384 (got 4, 16385)"),
    ),
    ("norm: eps NaN", "norm", {"eps": float("nan")}, (1, "engram_hc_rms_norm: eps must be finite and >= 0 (got nan)")),
    ("norm: -1 tokens", "norm", {"T": -1}, (1, "engram_hc_rms_norm: num_tokens must be in [0, 2^31 - 1] (got -1)")),
    ("norm: NULL hs", "norm", {"hs": None}, (1, "engram_hc_rms_norm: hs, weight and out must be bf16 device pointers")),
    (
        "norm: odd residual address",
        "norm",
        {"residual": ctypes.c_void_p(17)},
        (1, "engram_hc_rms_norm: residual must be NULL or a bf16 device pointer"),
    ),
    (
        "norm: out inside hs",
        "norm",
        {"out": ctypes.c_void_p(16 + 2048)},
        (1, "engram_hc_rms_norm: out, hs and residual must not overlap"),
    ),
    ("norm: zero tokens", "norm", {"T": 0, "hs": None}, (0, "")),
    (
        "silu: intermediate 0",
        "silu",
        {"I": 0},
        (1, "engram_silu_mul: need num_tokens >= 0 and intermediate_size >= 1 (got 4, 0)"),
    ),
    ("silu: NULL out", "silu", {"out": None}, (1, "engram_silu_mul: gate_up and out must be bf16 device pointers")),
    (
        "silu: out inside gate_up",
        "silu",
        {"out": ctypes.c_void_p(16 + 4 * 5632)},
        (1, "engram_silu_mul: out must not overlap gate_up"),
    ),
    ("silu: zero tokens", "silu", {"T": 0, "gu": None}, (0, "")),
    (
        "rope: heads 6 / 4",
        "rope",
        {"H": 6, "kvh": 4},
        (
            1,
            "engram_rope_kv_cache_write: num_heads must be a positive multiple of num_kv_heads (got num_heads 6, "
            "num_kv_heads 4)",
        ),
    ),
    (
        "rope: head_dim 264",
        "rope",
        {"hd": 264},
        (1, "engram_rope_kv_cache_write: head_dim must be a multiple of 8 in [8, 256] (got 264)"),
    ),
    (
        "rope: NULL token_slot",
        "rope",
        {"slot": None},
        (1, "engram_rope_kv_cache_write: token_slot and token_pos must be int32 device arrays"),
    ),
    (
        "rope: misaligned q_out",
        "rope",
        {"q_out": ctypes.c_void_p(24)},
        (
            1,
            "engram_rope_kv_cache_write: qkv, cos, sin, key_cache, value_cache and q_out must be 16-byte aligned "
            "device pointers",
        ),
    ),
    (
        "rope: q_out inside qkv",
        "rope",
        {"q_out": ctypes.c_void_p(16 + 4096)},
        (1, "engram_rope_kv_cache_write: q_out must not overlap qkv"),
    ),
    ("rope: zero tokens", "rope", {"T": 0}, (0, "")),
]


@pytest.mark.parametrize("name, entry, args, want", ABI_CASES, ids=[c[0] for c in ABI_CASES])
def test_abi(name: str, entry: str, args: dict, want: tuple[int, str]) -> None:
    got = backbone_abi(entry, **args)
    assert got == want, f"abi {name}: got {got}, want {want}"


# --- 3. the reference itself, on the CPU ------------------------------------------------------------

# The bounds hold for the PyTorch bf16 ops themselves (CPU), so a kernel that matches those
# ops within an ulp passes them: T 1 and 64, hc 1 and 4.
REFERENCE_CASES = [
    ("norm", (1, 4, 2048)),
    ("norm", (64, 4, 256)),
    ("norm", (64, 1, 1000)),
    ("rope", (1, 16, 8, 128)),
    ("rope", (64, 4, 2, 40)),
    ("silu", (1, 5632)),
    ("silu", (64, 13)),
]


def check_reference_cpu(kind: str, dims: tuple) -> None:
    """One case of REFERENCE_CASES: the PyTorch bf16 op on the CPU within the float64 bound."""
    import torch

    from engram_trt.models.engram_llama.kernel_ops import TorchBackboneOps
    from engram_trt.models.engram_llama.modules import rope_and_write

    gen = torch.Generator().manual_seed(7)
    cpu = torch.device("cpu")
    if kind == "norm":
        T, hc, D = dims
        inputs = norm_inputs(gen, cpu, T, hc, D, residual=True)
        hs = inputs["hs"].clone()
        out = TorchBackboneOps().norm(hs, inputs["residual"], norm_module(inputs["weight"], EPS))
        ok, detail = norm_verify(inputs, out, hs)
        assert ok, f"reference norm T={T} hc={hc} D={D} +residual (cpu): {detail}"
    elif kind == "rope":
        T, H, kvh, hd = dims
        inputs = rope_inputs(gen, cpu, T, H, kvh, hd, 8, 64, out_of_cache=False)
        q, k, v = (x.reshape(T, -1, hd) for x in inputs["qkv"].split([H * hd, kvh * hd, kvh * hd], dim=-1))
        keys, values = inputs["keys"].clone(), inputs["values"].clone()
        plan = SimpleNamespace(token_slots=inputs["slots"].long(), positions=inputs["pos"].long())
        got_q = rope_and_write(q, k, v, inputs["cos"], inputs["sin"], plan, keys, values)
        ok, detail = rope_verify(inputs, got_q, keys, values)
        assert ok, f"reference rope T={T} heads {H}/{kvh}/{hd} (cpu): {detail}"
    else:
        T, I = dims
        inputs = silu_inputs(gen, cpu, T, I)
        ok, detail = silu_verify(inputs, TorchBackboneOps().silu_mul(inputs["gate_up"]))
        assert ok, f"reference silu T={T} I={I} (cpu): {detail}"


@pytest.mark.parametrize(
    "kind, dims", REFERENCE_CASES, ids=[f"{k}-{'x'.join(map(str, d))}" for k, d in REFERENCE_CASES]
)
def test_reference_cpu(kind: str, dims: tuple) -> None:
    check_reference_cpu(kind, dims)


# --- 4. kernels on the GPU ----------------------------------------------------------------------------


def run_norm(inputs: dict, misaligned: bool = False):
    from engram_trt.native import backbone as backbone_kernels

    hs = placed(inputs["hs"], misaligned)
    return backbone_kernels.hc_rms_norm(hs, inputs["weight"], EPS, inputs["residual"]), hs


def run_rope(inputs: dict):
    from engram_trt.native import attention as attention_kernels

    keys, values = inputs["keys"].clone(), inputs["values"].clone()
    q = attention_kernels.rope_kv_cache_write(
        inputs["qkv"], inputs["cos"], inputs["sin"], keys, values, inputs["slots"], inputs["pos"], inputs["H"]
    )
    return q, keys, values


def run_silu(inputs: dict, misaligned: bool = False):
    from engram_trt.native import backbone as backbone_kernels

    return backbone_kernels.silu_mul(placed(inputs["gate_up"], misaligned))


# (T, hc, D, residual, misaligned): D 2048 at each T / hc / residual, then odd D (+residual)
NORM_CASES = [(T, hc, 2048, residual, False) for T in (1, 64, 256, 8192) for hc in (1, 4) for residual in (False, True)]
NORM_CASES += [
    (T, hc, D, True, misaligned)
    for T, hc, D, misaligned in (
        (64, 4, 2047, False),
        (64, 4, 1000, False),
        (64, 4, 3, False),
        (64, 3, 4096, False),
        (16, 4, 16384, False),
        (64, 4, 2048, True),
        (256, 1, 2047, True),
    )
]
# (T, H, kvh, hd, slots, max_len)
ROPE_CASES = [
    (1, 16, 8, 128, 4, 64),
    (64, 16, 8, 128, 8, 256),
    (256, 16, 8, 128, 8, 512),
    (8192, 16, 8, 128, 8, 2048),
    (64, 32, 8, 128, 4, 64),
    (64, 4, 4, 64, 4, 64),
    (64, 16, 8, 256, 4, 64),
    (64, 8, 2, 40, 4, 64),
    (16, 2, 1, 8, 2, 32),
]
# (T, I, misaligned)
SILU_CASES = [
    (1, 5632, False),
    (64, 5632, False),
    (256, 5632, False),
    (8192, 5632, False),
    (64, 1000, False),
    (64, 13, False),
    (3, 1, False),
    (64, 5632, True),
]


@pytest.mark.parametrize("T, hc, D, residual, misaligned", NORM_CASES)
def test_norm_kernel(gen, T: int, hc: int, D: int, residual: bool, misaligned: bool) -> None:
    import torch

    inputs = norm_inputs(gen, torch.device("cuda"), T, hc, D, residual)
    out, hs = run_norm(inputs, misaligned)
    ok, detail = norm_verify(inputs, out, hs)
    assert ok, (
        f"norm T={T} hc={hc} D={D}{' +residual' if residual else ''}{' misaligned' if misaligned else ''}: {detail}"
    )


@pytest.mark.parametrize("T, H, kvh, hd, slots, max_len", ROPE_CASES)
def test_rope_kernel(gen, T: int, H: int, kvh: int, hd: int, slots: int, max_len: int) -> None:
    import torch

    inputs = rope_inputs(gen, torch.device("cuda"), T, H, kvh, hd, slots, max_len)
    ok, detail = rope_verify(inputs, *run_rope(inputs))
    assert ok, f"rope+kv T={T} heads {H}/{kvh}/{hd} cache {slots}x{max_len}: {detail}"


@pytest.mark.parametrize("T, I, misaligned", SILU_CASES)
def test_silu_kernel(gen, T: int, I: int, misaligned: bool) -> None:
    import torch

    inputs = silu_inputs(gen, torch.device("cuda"), T, I)
    ok, detail = silu_verify(inputs, run_silu(inputs, misaligned))
    assert ok, f"silu*up T={T} I={I}{' misaligned' if misaligned else ''}: {detail}"


def test_graph(gen, rounds: int = 3) -> None:
    """The three kernels captured in one CUDA graph on static buffers, replayed with new
    data, positions and slots each round."""
    import torch

    dev = torch.device("cuda")
    make = {
        "norm": lambda: norm_inputs(gen, dev, 64, 4, 2048, True),
        "rope": lambda: rope_inputs(gen, dev, 64, 16, 8, 128, 8, 256),
        "silu": lambda: silu_inputs(gen, dev, 64, 5632),
    }
    static = {k: f() for k, f in make.items()}
    from engram_trt.native import attention as attention_kernels
    from engram_trt.native import backbone as backbone_kernels

    def body() -> tuple:
        n, r, s = static["norm"], static["rope"], static["silu"]
        out = backbone_kernels.hc_rms_norm(n["hs"], n["weight"], EPS, n["residual"])
        q = attention_kernels.rope_kv_cache_write(
            r["qkv"], r["cos"], r["sin"], r["keys"], r["values"], r["slots"], r["pos"], r["H"]
        )
        return out, q, backbone_kernels.silu_mul(s["gate_up"])

    from engram_trt.bench.common import capture_graph

    graph, outputs = capture_graph(body)
    for rnd in range(rounds):
        fresh = {k: f() for k, f in make.items()}
        for k, inputs in fresh.items():
            for name, t in inputs.items():
                if isinstance(t, torch.Tensor):
                    static[k][name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        out, q, silu = outputs
        results = {
            f"graph replay {rnd + 1}: norm T=64 hc=4 D=2048 +residual": norm_verify(
                fresh["norm"], out, static["norm"]["hs"]
            ),
            f"graph replay {rnd + 1}: rope+kv T=64 heads 16/8/128, new slots and positions": rope_verify(
                fresh["rope"], q, static["rope"]["keys"], static["rope"]["values"]
            ),
            f"graph replay {rnd + 1}: silu*up T=64 I=5632": silu_verify(fresh["silu"], silu),
        }
        failed = {name: detail for name, (ok, detail) in results.items() if not ok}
        assert not failed, "; ".join(f"{name}: {detail}" for name, detail in failed.items())


# --- 5. the 1.15B model -----------------------------------------------------------------------------

# The model, its decode variants and what each changes: tests/gpu/cases.py, shared
# with ``benchmarks/kernels/bench_backbone.py``, which times the same steps.


@pytest.fixture(scope="module")
def model_1b():
    """The bench's 1.15B model (``engram-trt bench step --model 1b``: random bf16 weights,
    fused at load on the GPU) with its tables in GPU memory: (model, layout, info)."""
    import torch

    got = build_model(torch.device("cuda"))
    yield got
    del got
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def twin(model_1b):
    """The model's float32 twin (the same weights, unfused), sharing its tables."""
    import torch

    from engram_trt.models.engram_llama.model import EngramLlama

    model, layout, _ = model_1b
    t = EngramLlama(
        model.config,
        {n: p.detach().float() for n, p in model.named_parameters()},
        compress_lookup=model.compress_lookup,
        layout=layout,
        device=model.device,
        dtype=torch.float32,
        fuse_projections=False,
    )
    t.set_tables(model.tables)
    return t


def check_model(model: Any, layout: Any, info: dict, seed: int, twin: Any) -> None:
    """The 1.15B model's paths against its float32 twin (the decode variants below check
    their steps against it too)."""
    import torch

    from engram_trt.models.engram_llama.model import model_weight_shapes
    from engram_trt.runtime.cuda_graphs import DecodeGraphs
    from engram_trt.models.step import PackedStep

    cfg = model.config
    kernels = model.backbone_ops
    fused = all(
        layer.self_attn.fused_weight() is not None and layer.mlp.fused_weight() is not None
        for layer in model.model.layers
    )
    assert kernels is not None and fused, (
        f"1.15B model: fused projections and the kernel library selected: {model.backend_name}"
    )
    names = [n for n, _ in model.named_parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sorted(names) == sorted(model_weight_shapes(cfg)) and sum(storages.values()) == info["weight_bytes"], (
        "1.15B model: parameter names are the checkpoint's, no weight stored twice: "
        f"{len(names)} parameters in {len(storages)} allocations of {sum(storages.values()) / 2**30:.3f} GiB, "
        f"the parameters {info['weight_bytes'] / 2**30:.3f} GiB"
    )

    gen = torch.Generator().manual_seed(seed)
    lens = [37, 64, 5, 100]
    S, steps = len(lens), 3
    history = [torch.randint(2, cfg.vocab_size, (n + steps,), generator=gen) for n in lens]
    max_len = max(lens) + steps + 8
    # "fused graphs over copies": the graphs' decode attention runs SDPA on copies of the
    # slots' K/V at this small context, where by default the warp kernel reads them in place.
    # "fused graphs, lookup apart": the GPU lookup replayed in graphs of its own beside the
    # step's segments, where by default it is forked onto the side stream inside one graph of
    # the step (the same kernels).
    paths = {
        "unfused eager": (None, False),
        "fused eager": (kernels, False),
        "fused graphs": (kernels, True),
        "unfused graphs": (None, True),
        "fused graphs over copies": (kernels, True),
        "fused graphs, lookup apart": (kernels, True),
    }
    caches = {name: model.new_cache(S + 1, max_len) for name in paths}  # + the graphs' scratch slot
    graphs = {
        name: DecodeGraphs(
            model,
            caches[name],
            S,
            scratch_slot=S,
            tables=model.tables,
            fork_lookup=name != "fused graphs, lookup apart",
        )
        for name, (_, g) in paths.items()
        if g
    }
    twin_cache = twin.new_cache(S + 1, max_len)
    lut = model.compress_lookup.cpu()
    n_back = layout.max_ngram_size - 1
    worst: dict[str, float] = {}
    for k in range(steps + 1):
        if k == 0:
            step = PackedStep(torch.cat([h[:n] for h, n in zip(history, lens)]), lens, [0] * S, list(range(S)))
            label = f"packed prefill {'+'.join(map(str, lens))}"
        else:
            past = [n + k - 1 for n in lens]
            ids = torch.stack([h[p] for h, p in zip(history, past)])
            lookback = torch.stack([lut[h[p - n_back : p]] for h, p in zip(history, past)])
            step = PackedStep(ids, [1] * S, past, list(range(S)), lookback=lookback)
            label = f"decode step {k} of {S} sequences"
        ref = twin.forward_step(step, twin_cache).float()
        logits = {}
        for name, (ops, in_graph) in paths.items():
            model.backbone_ops = ops
            with variant_settings(name):
                out = graphs[name].run(step, None) if in_graph and k > 0 else None
            assert not (in_graph and k > 0 and out is None), (
                f"{name}: {label} replayed from a graph: {graphs[name].failed or 'not replayed'}"
            )
            logits[name] = (out if out is not None else model.forward_step(step, caches[name])).float().clone()
        model.backbone_ops = kernels
        base = rel_err(logits["unfused eager"], ref)
        if k > 0:
            same = torch.equal(logits["fused graphs"], logits["fused graphs, lookup apart"])
            assert same and graphs["fused graphs"].handles_lookup(step), (
                f"1.15B {label}: the lookup forked in one graph of the step gives the separate lookup graphs' logits: "
                f"bit-identical={same}; GPU lookup in the graphs={graphs['fused graphs'].handles_lookup(step)}"
            )
        for name in (
            "fused eager",
            "fused graphs",
            "unfused graphs",
            "fused graphs over copies",
            "fused graphs, lookup apart",
        ):
            err = rel_err(logits[name], ref)
            worst[name] = max(worst.get(name, 0.0), err)
            ok = err <= 1.5 * base + 2e-3 and bool(torch.isfinite(logits[name]).all())
            assert ok, (
                f"1.15B {label}: {name} vs float32 twin: "
                f"rel L2 {err:.3e} (unfused eager {base:.3e}; vs unfused eager "
                f"{rel_err(logits[name], logits['unfused eager']):.3e}); argmax agrees with the twin on "
                f"{int((logits[name].argmax(-1) == ref.argmax(-1)).sum())}/{S}"
            )
    for name, g in graphs.items():
        assert g.failed is None and g.replays == steps, (
            f"1.15B decode graphs recorded and replayed ({name}): {g.failed or f'{g.replays} replays'}"
        )
    note("model", {"worst_rel_l2_vs_float32": worst, "backend": model.backend_name})
    model.backbone_ops = kernels
    del twin_cache, graphs, caches
    torch.cuda.empty_cache()


def twin_logits(twin: Any, cache: Any, step: Any, B: int, past: int) -> Any:
    """The float32 twin's logits of ``step`` on a float32 copy of ``cache``'s keys and values
    (its Engram layers removed, as the timed model's are)."""
    twin.engram_enabled = False
    twin_cache = twin.new_cache(B + 1, cache.keys[0].shape[2])
    for dst, src in zip(twin_cache.keys + twin_cache.values, cache.keys + cache.values):
        dst.copy_(src.float())
    for s in range(B):
        twin_cache.lengths[s] = past
    return twin.forward_step(step, twin_cache).float()


# --- the tests ---------------------------------------------------------------------------------------


def test_model(model_1b, twin, test_seed: int) -> None:
    model, layout, info = model_1b
    kernels = model.backbone_ops
    try:
        check_model(model, layout, info, test_seed, twin)
    finally:  # a failed check leaves the module's model as the next test needs it
        model.backbone_ops = kernels


@pytest.mark.parametrize("B", [1, 64, 256])
def test_decode_variants(model_1b, twin, B: int) -> None:
    """The decode steps ``benchmarks/kernels/bench_backbone.py`` times, checked: B sequences at context
    256, the Engram layers removed (the backbone), each variant (unfused, fused, the GEMM
    library's projections, no dependent launches, SDPA over copies or the tiled attention
    kernel) replayed from a CUDA graph (DecodeGraphs); fused vs unfused logits within 3e-2
    rel L2, and every variant against the float32 twin within the model's bound."""
    import numpy as np
    import torch

    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    model = model_1b[0]
    kernels = model.backbone_ops
    past = MODEL_OPTIONS.context
    rng = np.random.default_rng([1, B])
    model.engram_enabled = False  # the backbone alone, as the bench times it
    try:
        cache, step = decode_case(model, B, past, rng)
        last = {}
        for name, ops in decode_variants(model, B, past):
            model.backbone_ops = ops
            with variant_settings(name):
                graphs = DecodeGraphs(model, cache, B, scratch_slot=B, tables=None)
                one = decode_step(model, graphs, cache, step, B, past)
                for _ in range(3):  # the bench's warm-up: the graph recorded, then replayed
                    one()
                last[name] = one().float().clone()  # a graph's output buffer: the next replay overwrites it
            assert graphs.failed is None and graphs.replays > 0, (
                f"decode {B}: {name} step replayed from a CUDA graph: {graphs.failed or f'{graphs.replays} replays'}"
            )
        model.backbone_ops = kernels
        rel = rel_err(last["fused"], last["unfused"])
        assert rel < 3e-2, f"decode {B}: fused vs unfused logits on the timed step: rel L2 {rel:.3e}"
        ref = twin_logits(twin, cache, step, B, past)
        base = rel_err(last["unfused"], ref)
        for name in last:
            if name != "unfused":
                err = rel_err(last[name], ref)
                assert err <= 1.5 * base + 2e-3, (
                    f"decode {B}: {name} vs the float32 twin on the timed step: "
                    f"rel L2 {err:.3e} (unfused {base:.3e}); vs unfused {rel_err(last[name], last['unfused']):.3e}"
                )
    finally:
        model.backbone_ops = kernels
        model.engram_enabled = True
        twin.engram_enabled = True
        torch.cuda.empty_cache()
