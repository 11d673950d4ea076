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

from .helpers import U, combined, ulp_distance, within

SHAPES = {
    "qkv": (4096, 2048),
    "o": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
    "wkv": (10240, 6144),
    "lm_head": (129280, 2048),
}
# (label, T, N, K): the 1B model's shapes at 1..4 tokens (lm_head at 1 and 4), then odd N and K.
KERNEL_CASES = [
    (name, T, N, K) for name, (N, K) in SHAPES.items() for T in ((1, 2, 3, 4) if name != "lm_head" else (1, 4))
]
KERNEL_CASES += [
    ("odd", T, N, K)
    for T, N, K in (
        (1, 1, 2048),
        (2, 7, 8),
        (3, 1001, 40),
        (4, 3, 5632),
        (4, 2049, 1032),
        (3, 1031, 5640),
        (3, 4099, 2048),
    )
]
REFERENCE_CASES = [(1, 256, 2048), (4, 64, 5632), (8, 33, 40)]


def gemv_inputs(gen, device, T: int, N: int, K: int) -> dict:
    import torch

    x = torch.randn(T, K, generator=gen, device=device)
    w = torch.randn(N, K, generator=gen, device=device) * 0.02
    if T * K > 4:
        x.view(-1)[:4] = torch.tensor([300.0, -300.0, 0.0, -0.0], device=device)  # large and signed zeros
    return {"x": x.to(torch.bfloat16), "w": w.to(torch.bfloat16)}


def gemv_verify(inputs: dict, got, terms: float | None = None) -> tuple[bool, str]:
    """``got`` against float64 (``terms`` float32 additions: the kernel's by default) and
    against F.linear on the same device: (ok, detail)."""
    import torch.nn.functional as F

    x, w = inputs["x"], inputs["w"]
    K = x.shape[1]
    n = K / 32 + 5 if terms is None else terms
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    bound = U * ref.abs() + (1 + U) * n * 2.0**-24 * (1 + 2.0**-20) * mag + 1e-30
    results = [within(got, ref, bound)]
    if terms is None:
        results.append(versus_linear(got, F.linear(x, w)))
    return combined(*results)


def versus_linear(got, want) -> tuple[bool, str]:
    """At most 1% of the elements differ from F.linear's. No ulp limit: near a cancelled
    sum a bf16 ulp is smaller than either float32 sum's error, which the float64 bound
    judges."""
    d = ulp_distance(got, want)
    differing = float((d > 0).float().mean()) if d.numel() else 0.0
    return (
        differing <= 0.01,
        f"vs F.linear: {differing:.2e} of elements differ (max {int(d.max()) if d.numel() else 0} ulp)",
    )


# --- 1. ABI (no GPU) -----------------------------------------------------------------------------

_P = ctypes.c_void_p(16)  # never read: every call below fails on its arguments first (or launches nothing)
_BAD_SHAPE = "engram_gemv_bf16: need 1 <= out_features <= 2^31 - 1 and in_features a multiple of 8 in [8, 2^31 - 1]"
_ALIGNED = "engram_gemv_bf16: x, weight and out must be 16-byte aligned device pointers"
# (name, the arguments that differ from a good call, (status, last error) wanted)
ABI_CASES = [
    ("5 tokens", {"T": 5}, (1, "engram_gemv_bf16: num_tokens must be in [0, 4] (got 5)")),
    ("-1 tokens", {"T": -1}, (1, "engram_gemv_bf16: num_tokens must be in [0, 4] (got -1)")),
    ("in_features 12", {"K": 12}, (1, f"{_BAD_SHAPE} (got 2048, 12)")),
    ("out_features 0", {"N": 0}, (1, f"{_BAD_SHAPE} (got 0, 2048)")),
    (
        "flags 2",
        {"flags": 2},
        (1, "engram_gemv_bf16: unknown flags 0x2 (the one flag is ENGRAM_GEMV_WEIGHT_STATIC = 0x1)"),
    ),
    ("NULL x", {"x": None}, (1, _ALIGNED)),
    ("misaligned weight", {"w": ctypes.c_void_p((1 << 40) + 8)}, (1, _ALIGNED)),
    (
        "out inside weight",
        {"out": ctypes.c_void_p((1 << 40) + 4096)},
        (1, "engram_gemv_bf16: out must not overlap x or weight"),
    ),
    ("out over x", {"out": _P}, (1, "engram_gemv_bf16: out must not overlap x or weight")),
    ("zero tokens", {"T": 0, "x": None}, (0, "")),
]


def gemv_abi(
    x=_P, w=ctypes.c_void_p(1 << 40), T=1, N=2048, K=2048, flags=1, out=ctypes.c_void_p(1 << 41)
) -> tuple[int, str]:
    """engram_gemv_bf16 called with these arguments: (status, its last error)."""
    from engram_trt.native import backbone as backbone_kernels

    lib = backbone_kernels.library()
    status = lib.engram_gemv_bf16(x, w, T, N, K, flags, out, None)
    return status, lib.engram_last_error().decode()


@pytest.mark.parametrize("name, args, want", ABI_CASES, ids=[c[0] for c in ABI_CASES])
def test_abi(name: str, args: dict, want: tuple[int, str]) -> None:
    got = gemv_abi(**args)
    assert got == want, f"abi gemv: {name}: got {got}, want {want}"


# --- 2. the reference on the CPU --------------------------------------------------------------------


def check_reference_cpu(T: int, N: int, K: int) -> None:
    """The float64 bound holds for F.linear on the CPU (any summation order: K terms)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(7)
    inputs = gemv_inputs(gen, torch.device("cpu"), T, N, K)
    ok, detail = gemv_verify(inputs, F.linear(inputs["x"], inputs["w"]), terms=K)
    assert ok, f"reference F.linear T={T} N={N} K={K} (cpu, any summation order): {detail}"


@pytest.mark.parametrize("T, N, K", REFERENCE_CASES)
def test_reference_cpu(T: int, N: int, K: int) -> None:
    check_reference_cpu(T, N, K)


# --- 3. the kernel on the GPU ------------------------------------------------------------------------


@pytest.mark.parametrize("label, T, N, K", KERNEL_CASES, ids=[f"{c[0]}-T{c[1]}-N{c[2]}-K{c[3]}" for c in KERNEL_CASES])
def test_kernels(gen, label: str, T: int, N: int, K: int) -> None:
    import torch

    from engram_trt.native import backbone as backbone_kernels

    inputs = gemv_inputs(gen, torch.device("cuda"), T, N, K)
    ok, detail = gemv_verify(inputs, backbone_kernels.gemv(inputs["x"], inputs["w"]))
    assert ok, f"gemv {label} T={T} N={N} K={K}: {detail}"


def test_weight_static_out_and_zero_tokens(gen) -> None:
    """T=3 N=4099 K=2048 told its weight is static; into a given out buffer (every element
    written, the given out returned); zero tokens give an empty [0, N]."""
    import torch

    from engram_trt.native import backbone as backbone_kernels

    dev = torch.device("cuda")
    inputs = gemv_inputs(gen, dev, 3, 4099, 2048)
    ok, detail = gemv_verify(inputs, backbone_kernels.gemv(inputs["x"], inputs["w"], weight_static=True))
    assert ok, f"gemv T=3 N=4099 K=2048, weight static: {detail}"
    out = torch.full((3, 4099), float("nan"), device=dev, dtype=torch.bfloat16)
    got = backbone_kernels.gemv(inputs["x"], inputs["w"], out=out)
    ok, detail = gemv_verify(inputs, out)
    assert ok, f"gemv into a given out (every element written): {detail}"
    assert got.data_ptr() == out.data_ptr(), f"gemv returns the given out: {got.data_ptr():#x}"
    empty = backbone_kernels.gemv(inputs["x"][:0], inputs["w"])
    assert tuple(empty.shape) == (0, 4099), f"gemv of zero tokens: an empty [0, N]: {tuple(empty.shape)}"


def test_graph(gen, rounds: int = 3) -> None:
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
        ok, detail = gemv_verify(fresh, out)
        assert ok, f"graph replay {rnd + 1}: gemv T=1 N=4096 K=2048, new x and weight: {detail}"


def test_dependent_chain(gen, rounds: int = 4) -> None:
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
        fresh = bool(((h.double() - silu).abs() <= (2 * U * (1 + U) + 2.0**-20) * silu.abs() + 1e-30).all())
        assert fresh, f"dependent chain replay {rnd + 1}: SiLU * up of this replay's input"
        ok, detail = gemv_verify({"x": h, "w": w1}, y1)
        assert ok, f"dependent chain replay {rnd + 1}: GEMV of the SiLU output: {detail}"
        ok, detail = gemv_verify({"x": y1, "w": w2}, y2)
        assert ok, f"dependent chain replay {rnd + 1}: GEMV of that GEMV's output: {detail}"
