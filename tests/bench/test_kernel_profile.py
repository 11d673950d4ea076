"""``bench e2e --breakdown-kernels``' arithmetic on the CPU (bench/breakdown.py): the GPU
records of a profile told apart by step, summed by kernel and named short.

- ``summarize_kernels`` on synthetic records of 4 steps (shuffled; steps of different
  record counts, a gap inside a step, work that overlaps, one name under several template
  arguments, copies and memsets): every per-step figure equal to the same sums taken over
  the steps as they were made (dyadic times: the float64 sums are exact in any order);
- ``kernel_short_name`` on kernel names as CUPTI reports them (ours, torch's, cuBLAS',
  cutlass' wrappers), each against the name written out by hand;
- ``device_records`` on torch's own ``FunctionEvent`` objects (the fields read);
- ``format_kernel_profile``: the rows' figures, the top-25 cut and the rest's sum;
- ``decode_kernel_profile`` off CUDA: refused before anything is loaded.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from engram_trt.bench.breakdown import (
    device_records,
    format_kernel_profile,
    kernel_short_name,
    summarize_kernels,
)

FOLD_BF16 = (
    "void engram_trt::kernels::(anonymous namespace)::mhcFoldMixKernel<__nv_bfloat16, 3, 4>"
    "(__nv_bfloat16 const*, float const*, __nv_bfloat16*, int)"
)
FOLD_F32 = (
    "void engram_trt::kernels::(anonymous namespace)::mhcFoldMixKernel<float, 1, 4>"
    "(float const*, float const*, float*, int)"
)
FILL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)"
)
GEMM = (
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas"
)
COPY = "Memcpy HtoD (Pinned -> Device)"
MEMSET = "Memset (Device)"
CHECK = "void engram_trt::kernels::badRowsKernel(int const*, int*, int)"

SHORT = {
    FOLD_BF16: "mhcFoldMixKernel",
    FOLD_F32: "mhcFoldMixKernel",
    FILL: "vectorized_elementwise_kernel",
    GEMM: "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_",
    COPY: COPY,
    MEMSET: MEMSET,
    CHECK: "badRowsKernel",
}


def _steps() -> list[list[tuple[str, float, float]]]:
    """4 steps of ``(name, start_us, duration_us)``, each 5,000 us after the last: step 1
    has an extra check kernel, step 2 a memset overlapping the GEMM (another stream),
    step 3 a 60 us gap after its copy (the host between the copy and the replay)."""
    seq = [
        (COPY, 0.0, 1.25),
        (FILL, 3.5, 2.0),
        (FOLD_BF16, 6.0, 5.75),
        (GEMM, 12.25, 40.5),
        (FOLD_F32, 53.0, 4.25),
        (FILL, 58.0, 1.75),
        (FILL, 60.5, 2.5),
    ]
    steps = []
    for k in range(4):
        base = 123.5 + 5000.0 * k
        rows = [(n, base + t, d + 0.25 * k) for n, t, d in seq]
        if k == 1:
            rows.append((CHECK, base + 64.0, 3.0))
        if k == 2:
            rows.append((MEMSET, base + 20.0, 6.5))  # inside the GEMM's span
        if k == 3:
            rows = [rows[0]] + [(n, t + 60.0, d) for n, t, d in rows[1:]]
        steps.append(rows)
    return steps


def test_summarize_kernels_per_step_figures_equal_the_sums_over_the_made_steps() -> None:
    steps = _steps()
    records = [r for s in steps for r in s]
    random.Random(0).shuffle(records)
    reps = len(steps)
    got = summarize_kernels(records, reps)

    want: dict[str, dict[str, Any]] = {}
    for s in steps:
        for name, _, dur in s:
            w = want.setdefault(SHORT[name], {"n": 0, "durs": [], "full": set()})
            w["n"] += 1
            w["durs"].append(dur)
            w["full"].add(name)
    spans = [max(t + d for _, t, d in s) - min(t for _, t, _ in s) for s in steps]
    busy_ms = math.fsum(d for s in steps for _, _, d in s) / reps / 1000
    span_ms = math.fsum(spans) / reps / 1000
    assert got["busy_ms"] == busy_ms and got["span_ms"] == span_ms
    assert got["idle_ms"] == span_ms - busy_ms
    assert set(got["kernels"]) == set(want)
    for short, w in want.items():
        k = got["kernels"][short]
        assert k["calls"] == w["n"] / reps, short
        assert k["ms"] == math.fsum(w["durs"]) / reps / 1000, short
        assert k["us_each"] == math.fsum(w["durs"]) / w["n"], short
        assert set(k["full"]) == w["full"] and len(k["full"]) == len(w["full"]), short
    assert got["kernels"]["mhcFoldMixKernel"]["calls"] == 2.0 and got["kernels"]["badRowsKernel"]["calls"] == 0.25
    ms = {s: math.fsum(w["durs"]) for s, w in want.items()}
    assert got["order"] == sorted(ms, key=lambda s: -ms[s])


def test_summarize_kernels_one_step_and_refusals() -> None:
    rows = [(FILL, 10.0, 2.0), (FILL, 11.0, 4.0), (GEMM, 30.0, 8.5)]  # overlapping fills
    got = summarize_kernels(rows, 1)
    assert got["span_ms"] == 28.5 / 1000 and got["busy_ms"] == 14.5 / 1000
    assert got["kernels"]["vectorized_elementwise_kernel"] == {
        "calls": 2.0,
        "ms": 6.0 / 1000,
        "us_each": 3.0,
        "full": [FILL],
    }
    # two steps: the widest gap (15 us from the fills' end to the first GEMM) splits them
    two = summarize_kernels(rows + [(GEMM, 31.0, 1.0)], 2)
    assert two["span_ms"] == (5.0 + 8.5) / 2 / 1000
    # a gap is from the end of all the work before it: the GEMM on another stream spans the
    # fills' 84 us gap, so the steps part at the 10 us gap after the GEMM
    side = [(GEMM, 0.0, 100.0), (FILL, 5.0, 1.0), (FILL, 90.0, 1.0), (COPY, 110.0, 1.0), (COPY, 112.0, 1.0)]
    assert summarize_kernels(side, 2)["span_ms"] == (100.0 + 3.0) / 2 / 1000
    with pytest.raises(ValueError, match="reps 0"):
        summarize_kernels(rows, 0)
    with pytest.raises(ValueError, match="3 GPU records for 4 steps"):
        summarize_kernels(rows, 4)


@pytest.mark.parametrize(
    ("name", "short"),
    [
        *SHORT.items(),
        (
            "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>"
            "(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}"
            "::operator()() const::{lambda(float)#1} const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast"
            "<...>::{lambda(int)#1})",
            "elementwise_kernel",
        ),
        (
            "void (anonymous namespace)::softmax_warp_forward<float, float, float, 8, false, false>"
            "(float*, float const*, int, int, int, bool const*, int, bool)",
            "softmax_warp_forward",
        ),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
            "unsigned int, long, 4> >"
            "(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)",
            "reduce_kernel",
        ),
        (
            "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
            "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
            "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_t",
        ),
        (
            "void cutlass::device_kernel<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, "
            "cute::tuple<cute::C<1>, cute::C<1> > >, int> >(flash::FlashAttnFwdSm90<int>::Params)",
            "FlashAttnFwdSm90",
        ),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"),
        ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)"),
    ],
)
def test_kernel_short_name(name: str, short: str) -> None:
    assert kernel_short_name(name) == short


def test_device_records_reads_torch_function_events() -> None:
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def ev(name: str, start: float, end: float, kind: str, device: Any = DeviceType.CUDA) -> FunctionEvent:
        return FunctionEvent(0, name, 1, start, end, device_type=device, activity_type=kind)

    events = [
        ev("aten::mm", 1.0, 9.0, "cpu_op", DeviceType.CPU),
        ev("cudaGraphLaunch", 2.0, 4.0, "cuda_runtime", DeviceType.CPU),
        ev(FOLD_BF16, 10.5, 16.25, "kernel"),
        ev(COPY, 8.0, 9.25, "gpu_memcpy"),
        ev(MEMSET, 17.0, 17.5, "gpu_memset"),
        ev("step", 8.0, 20.0, "gpu_user_annotation"),
        ev("Stream Sync", 18.0, 19.0, "cuda_sync"),
        ev(FILL, 20.0, 22.5, None),  # a CUDA record of no known type: work
    ]
    records, seen = device_records(events)
    assert records == [(FOLD_BF16, 10.5, 5.75), (COPY, 8.0, 1.25), (MEMSET, 17.0, 0.5), (FILL, 20.0, 2.5)]
    assert seen == [
        "cpu_op",
        "cuda_runtime",
        "kernel",
        "gpu_memcpy",
        "gpu_memset",
        "gpu_user_annotation",
        "cuda_sync",
        "None",
    ]


def _profile(records: list[tuple[str, float, float]], reps: int) -> dict[str, Any]:
    return {"family": "qwen4-exp", "mode": "graph", "steps": reps, "step_ms": 0.5, **summarize_kernels(records, reps)}


def test_format_kernel_profile_rows() -> None:
    p = _profile([r for s in _steps() for r in s], 4)
    lines = format_kernel_profile(p)
    assert lines[0] == (
        f"kernels of one decode step (graph, mean of 4): step 0.500 ms (CUDA events), kernels busy "
        f"{p['busy_ms']:.3f} ms, first start to last end {p['span_ms']:.3f} ms, idle {p['idle_ms']:.3f} ms"
    )
    rows = lines[2:]
    assert len(rows) == len(p["kernels"]) == 6
    shares = 0.0
    for name, row in zip(p["order"], rows):
        k = p["kernels"][name]
        assert row.split()[:-4] == name.split()
        calls, ms, each, share = row.split()[-4:]
        assert (float(calls), float(ms), float(each)) == (
            round(k["calls"], 2),
            round(k["ms"], 3),
            round(k["us_each"], 2),
        ), name
        assert float(share.rstrip("%")) == pytest.approx(100 * k["ms"] / p["busy_ms"], abs=0.05)
        shares += 100 * k["ms"] / p["busy_ms"]
    assert shares == pytest.approx(100.0)
    assert rows[0].split()[0] == SHORT[GEMM]  # the GEMM: most of every step


def test_format_kernel_profile_names_a_batch_step() -> None:
    """A step of several sequences (bench e2e --breakdown-streams) says how many."""
    p = dict(_profile([r for s in _steps() for r in s], 4), sequences=12)
    assert format_kernel_profile(p)[0].startswith("kernels of one decode step of 12 sequences (graph, mean of 4): ")


def test_format_kernel_profile_cuts_at_25() -> None:
    records = [(f"void k{i:02d}(float*)", 100.0 * i, 1.0 + i) for i in range(30)]
    p = _profile(records, 1)
    lines = format_kernel_profile(p)
    assert [r.split()[0] for r in lines[2:-1]] == [f"k{i:02d}" for i in range(29, 4, -1)]
    assert lines[-1] == f"  (5 more kernels: {(1.0 + 2.0 + 3.0 + 4.0 + 5.0) / 1000:.3f} ms)"
    assert format_kernel_profile({"skipped": "why"}) == ["kernel profile: skipped (why)"]


def test_decode_kernel_profile_refused_off_cuda(tmp_path: Any) -> None:
    from engram_trt.bench.breakdown import decode_kernel_profile

    got = decode_kernel_profile(tmp_path / "absent", device="cpu", dtype="fp32", prompt_tokens=4, reps=2)
    assert got == {"skipped": "no CUDA device (the kernel profile reads the GPU's kernel records)"}
