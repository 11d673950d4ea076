// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The gate's scalar math (gateMath.h, the functions the CUDA kernel calls) run on the
 * host over whole tokens, so tests/kernels/test_gate_math.py can compare it with the float64
 * reference (engram_trt.engram.fusion.engram_gate_reference) on a machine without a
 * GPU: NaN propagation, sign(0), the clamp, masked tokens.
 *
 * stdin (whitespace-separated decimal text; "nan" / "inf" accepted):
 *   T hc D eps clamp
 *   hidden [T*hc*D]  kv [T*(hc+1)*D]  q [hc*D]  k [hc*D]  mask [T] (0 = dead)
 * stdout: out [T*hc*D], one value per line ("%.9g": float32 round-trips).
 * It mirrors one kernel block per (token, stream): the three sums, the score, the gate,
 * the update, and the bit copy of hidden for a dead token. Only the order of the fp32
 * additions differs from the kernel's block reduction.
 */
#include "gateMath.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace
{

bool readFloats(std::vector<float>& values, size_t count)
{
    values.resize(count);
    for (size_t i = 0; i < count; ++i)
    {
        if (std::scanf("%f", &values[i]) != 1)
        {
            return false;
        }
    }
    return true;
}

} // namespace

int main()
{
    using namespace engram_trt::kernels;
    long long tokens = 0;
    int hc = 0;
    int hiddenSize = 0;
    float eps = 0.0F;
    float clamp = 0.0F;
    if (std::scanf("%lld %d %d %f %f", &tokens, &hc, &hiddenSize, &eps, &clamp) != 5 || tokens < 0 || hc < 1
        || hiddenSize < 1)
    {
        std::fprintf(stderr, "gateMathTest: bad header (want: T hc D eps clamp)\n");
        return 2;
    }
    size_t const t = static_cast<size_t>(tokens);
    size_t const d = static_cast<size_t>(hiddenSize);
    size_t const streams = static_cast<size_t>(hc);
    std::vector<float> hidden, kv, q, k, mask;
    if (!readFloats(hidden, t * streams * d) || !readFloats(kv, t * (streams + 1) * d) || !readFloats(q, streams * d)
        || !readFloats(k, streams * d) || !readFloats(mask, t))
    {
        std::fprintf(stderr, "gateMathTest: input ends early\n");
        return 2;
    }
    for (size_t token = 0; token < t; ++token)
    {
        float const* value = &kv[(token * (streams + 1) + streams) * d];
        for (size_t c = 0; c < streams; ++c)
        {
            float const* h = &hidden[(token * streams + c) * d];
            float const* key = &kv[(token * (streams + 1) + c) * d];
            if (mask[token] == 0.0F)
            {
                for (size_t j = 0; j < d; ++j)
                {
                    std::printf("%.9g\n", h[j]);
                }
                continue;
            }
            float dot = 0.0F;
            float hh = 0.0F;
            float kk = 0.0F;
            for (size_t j = 0; j < d; ++j)
            {
                gateAccumulate(h[j], key[j], q[c * d + j], k[c * d + j], dot, hh, kk);
            }
            float const g = gateFromScore(gateScore(dot, hh, kk, hiddenSize, eps), clamp);
            for (size_t j = 0; j < d; ++j)
            {
                std::printf("%.9g\n", gateUpdate(h[j], g, value[j]));
            }
        }
    }
    return 0;
}
