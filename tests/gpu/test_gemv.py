"""The kernel library's GEMV (engram_gemv_bf16, plugins/kernels/gemvKernel.cu) on a GPU
(formerly scripts/h200_gemv_check.py): the decode step's projections for 1..4 tokens.

  abi        every bad argument refused on the host with its one-line reason; zero
             tokens launch nothing (needs no GPU; the CPU suite runs it too).
  reference  the bound below holds for the GEMM library's own bf16 F.linear on the CPU
             (so the bound judges the kernel, not its slack).
  kernels    against float64 (the bound below) and against F.linear on the GPU (<= 1% of
             elements differing: only the sums' order differs): T 1..4; the 1B model's
             shapes (qkv, o, gate_up, down, wkv, lm_head); odd N (1, 7, 1001, 4099); K 8,
             40, 1032, 5632, 5640; large and signed inputs; a given out buffer; zero
             tokens; captured in a CUDA graph and replayed with new x and weights; SiLU ->
             GEMV -> GEMV in one graph with weight_static (programmatic dependent launch on
             sm_90: each kernel may start before the one before it ends), each output
             against float64 on the input of its own replay.

Timing is `benchmarks/kernels/bench_gemv.py`.

Bound against float64 on the same bf16 inputs, elementwise, u = 2^-8:
  |out - ref| <= u |ref| + (1 + u) n 2^-24 (1 + 2^-20) sum_k |w x|
the output's one rounding, and n float32 additions of products that fmaf forms exactly:
n = K / 32 + 5 for the kernel (each lane's sequential sum, then a 5-level butterfly),
n = K for the reference (any summation order).
"""

from __future__ import annotations

import ctypes

import pytest

from .helpers import U, check, record, say, ulp_distance, within

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "wkv": (10240, 6144), "lm_head": (129280, 2048)}


def gemv_inputs(gen, device, T: int, N: int, K: int) -> dict:
    import torch

    x = torch.randn(T, K, generator=gen, device=device)
    w = torch.randn(N, K, generator=gen, device=device) * 0.02
    if T * K > 4:
        x.view(-1)[:4] = torch.tensor([300.0, -300.0, 0.0, -0.0], device=device)  # large and signed zeros
    return {"x": x.to(torch.bfloat16), "w": w.to(torch.bfloat16)}


def gemv_verify(name: str, inputs: dict, got, terms: float | None = None) -> bool:
    """``got`` against float64 (``terms`` float32 additions: the kernel's by default) and
    against F.linear on the same device."""
    import torch.nn.functional as F

    x, w = inputs["x"], inputs["w"]
    K = x.shape[1]
    n = K / 32 + 5 if terms is None else terms
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    bound = U * ref.abs() + (1 + U) * n * 2.0 ** -24 * (1 + 2.0 ** -20) * mag + 1e-30
    results = [within(got, ref, bound)]
    if terms is None:
        results.append(versus_linear(got, F.linear(x, w)))
    return check(name, *results)


def versus_linear(got, want) -> tuple[bool, str]:
    """At most 1% of the elements differ from F.linear's. No ulp limit: near a cancelled
    sum a bf16 ulp is smaller than either float32 sum's error, which the float64 bound
    judges."""
    d = ulp_distance(got, want)
    differing = float((d > 0).float().mean()) if d.numel() else 0.0
    return differing <= 0.01, f"vs F.linear: {differing:.2e} of elements differ (max {int(d.max()) if d.numel() else 0} ulp)"


# --- 1. ABI (no GPU) -----------------------------------------------------------------------------

def check_abi() -> None:
    from engram_trt.native import backbone as backbone_kernels

    lib = backbone_kernels.library()
    p = ctypes.c_void_p(16)  # never read: every call below fails on its arguments first (or launches nothing)

    def gemv(x=p, w=ctypes.c_void_p(1 << 40), T=1, N=2048, K=2048, flags=1, out=ctypes.c_void_p(1 << 41)):
        status = lib.engram_gemv_bf16(x, w, T, N, K, flags, out, None)
        return status, lib.engram_last_error().decode()

    cases = [
        ("5 tokens", gemv(T=5), (1, "engram_gemv_bf16: num_tokens must be in [0, 4] (got 5)")),
        ("-1 tokens", gemv(T=-1), (1, "engram_gemv_bf16: num_tokens must be in [0, 4] (got -1)")),
        ("in_features 12", gemv(K=12), (1, "engram_gemv_bf16: need 1 <= out_features <= 2^31 - 1 and in_features a "
                                           "multiple of 8 in [8, 2^31 - 1] (got 2048, 12)")),
        ("out_features 0", gemv(N=0), (1, "engram_gemv_bf16: need 1 <= out_features <= 2^31 - 1 and in_features a "
                                          "multiple of 8 in [8, 2^31 - 1] (got 0, 2048)")),
        ("flags 2", gemv(flags=2), (1, "engram_gemv_bf16: unknown flags 0x2 (the one flag is "
                                       "ENGRAM_GEMV_WEIGHT_STATIC = 0x1)")),
        ("NULL x", gemv(x=None), (1, "engram_gemv_bf16: x, weight and out must be 16-byte aligned device pointers")),
        ("misaligned weight", gemv(w=ctypes.c_void_p((1 << 40) + 8)),
         (1, "engram_gemv_bf16: x, weight and out must be 16-byte aligned device pointers")),
        ("out inside weight", gemv(out=ctypes.c_void_p((1 << 40) + 4096)),
         (1, "engram_gemv_bf16: out must not overlap x or weight")),
        ("out over x", gemv(out=p), (1, "engram_gemv_bf16: out must not overlap x or weight")),
        ("zero tokens", gemv(T=0, x=None), (0, "")),
    ]
    for name, got, want in cases:
        record(f"abi gemv: {name}", got == want, f"got {got}" + ("" if got == want else f", want {want}"))


# --- 2. the reference on the CPU --------------------------------------------------------------------

def check_reference_cpu() -> None:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(7)
    for T, N, K in ((1, 256, 2048), (4, 64, 5632), (8, 33, 40)):
        inputs = gemv_inputs(gen, torch.device("cpu"), T, N, K)
        gemv_verify(f"reference F.linear T={T} N={N} K={K} (cpu, any summation order)", inputs,
                    F.linear(inputs["x"], inputs["w"]), terms=K)


# --- 3. the kernel on the GPU ------------------------------------------------------------------------

def check_kernels(gen) -> None:
    import torch

    from engram_trt.native import backbone as backbone_kernels

    dev = torch.device("cuda")
    for name, (N, K) in SHAPES.items():
        for T in (1, 2, 3, 4) if name != "lm_head" else (1, 4):
            inputs = gemv_inputs(gen, dev, T, N, K)
            gemv_verify(f"gemv {name} T={T} N={N} K={K}", inputs, backbone_kernels.gemv(inputs["x"], inputs["w"]))
    for T, N, K in ((1, 1, 2048), (2, 7, 8), (3, 1001, 40), (4, 3, 5632), (4, 2049, 1032), (3, 1031, 5640)):
        inputs = gemv_inputs(gen, dev, T, N, K)
        gemv_verify(f"gemv T={T} N={N} K={K}", inputs, backbone_kernels.gemv(inputs["x"], inputs["w"]))
    inputs = gemv_inputs(gen, dev, 3, 4099, 2048)
    gemv_verify("gemv T=3 N=4099 K=2048", inputs, backbone_kernels.gemv(inputs["x"], inputs["w"]))
    gemv_verify("gemv T=3 N=4099 K=2048, weight static", inputs,
                backbone_kernels.gemv(inputs["x"], inputs["w"], weight_static=True))
    out = torch.full((3, 4099), float("nan"), device=dev, dtype=torch.bfloat16)
    got = backbone_kernels.gemv(inputs["x"], inputs["w"], out=out)
    gemv_verify("gemv into a given out (every element written)", inputs, out)
    record("gemv returns the given out", got.data_ptr() == out.data_ptr(), f"{got.data_ptr():#x}")
    empty = backbone_kernels.gemv(inputs["x"][:0], inputs["w"])
    record("gemv of zero tokens: an empty [0, N]", tuple(empty.shape) == (0, 4099), str(tuple(empty.shape)))


def check_graph(gen, rounds: int = 3) -> None:
    import torch

    from engram_trt.native import backbone as backbone_kernels
    from engram_trt.bench.common import capture_graph

    dev = torch.device("cuda")
    static = gemv_inputs(gen, dev, 1, 4096, 2048)
    graph, out = capture_graph(lambda: backbone_kernels.gemv(static["x"], static["w"]))
    for rnd in range(rounds):
        fresh = gemv_inputs(gen, dev, 1, 4096, 2048)
        static["x"].copy_(fresh["x"]), static["w"].copy_(fresh["w"])
        graph.replay()
        torch.cuda.synchronize()
        gemv_verify(f"graph replay {rnd + 1}: gemv T=1 N=4096 K=2048, new x and weight", fresh, out)


def check_dependent_chain(gen, rounds: int = 4) -> None:
    """SiLU * up -> GEMV -> GEMV in one CUDA graph, each GEMV told its weight is static:
    with programmatic dependent launch each kernel may start before the one before it
    ends, so a missing wait would read the last replay's input. Each replay gets new
    inputs; each output is checked against float64 on the input it should have read."""
    import torch

    from engram_trt.native import backbone as backbone_kernels
    from engram_trt.bench.common import capture_graph

    dev = torch.device("cuda")
    gate_up = (torch.randn(1, 2 * 5632, generator=gen, device=dev) * 2).to(torch.bfloat16)
    w1 = (torch.randn(2048, 5632, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(4096, 2048, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

    def body() -> tuple:
        h = backbone_kernels.silu_mul(gate_up)
        y1 = backbone_kernels.gemv(h, w1, weight_static=True)
        return h, y1, backbone_kernels.gemv(y1, w2, weight_static=True)

    graph, (h, y1, y2) = capture_graph(body)
    for rnd in range(rounds):
        gate_up.copy_((torch.randn(1, 2 * 5632, generator=gen, device=dev) * 2).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        g, u = gate_up.double().chunk(2, dim=-1)
        silu = g / (1 + (-g).exp()) * u
        fresh = bool(((h.double() - silu).abs() <= (2 * U * (1 + U) + 2.0 ** -20) * silu.abs() + 1e-30).all())
        record(f"dependent chain replay {rnd + 1}: SiLU * up of this replay's input", fresh, "")
        gemv_verify(f"dependent chain replay {rnd + 1}: GEMV of the SiLU output", {"x": h, "w": w1}, y1)
        gemv_verify(f"dependent chain replay {rnd + 1}: GEMV of that GEMV's output", {"x": y1, "w": w2}, y2)



# --- the tests ---------------------------------------------------------------------------------------

def test_abi() -> None:
    check_abi()


def test_reference_cpu() -> None:
    check_reference_cpu()


def test_kernels(gen) -> None:
    import torch

    say(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    check_kernels(gen)


def test_graph(gen) -> None:
    check_graph(gen)


def test_dependent_chain(gen) -> None:
    check_dependent_chain(gen)
