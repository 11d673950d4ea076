#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The stored-format kernels on one GPU in one command, one build: the GPU tests of
# quantKernels.h (tests/gpu/test_quant_kernels.py, tests/gpu/test_quant_fast.py, through
# tests/gpu/run_h200.sh, which builds the library for sm_90) and then the microbenchmark
# (bench_quant.py --quick) on the library that run built:
#
#   OUT=/some/folder bash benchmarks/kernels/run_quant_gpu.sh
#
# $OUT receives run_h200.sh's files (gpu.log, summary.json, gpu-json.tar.gz, build.log),
# bench_quant.json and bench_quant.log. Exit status: the tests', else the benchmark's.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export OUT
export ENGRAM_TRT_GPU_BUILD=${ENGRAM_TRT_GPU_BUILD:-/tmp/engram-trt-h200}
GPU_TIMEOUT=${GPU_TIMEOUT:-300} bash tests/gpu/run_h200.sh tests/gpu/test_quant_kernels.py tests/gpu/test_quant_fast.py
TESTS=$?
LIB=${ENGRAM_TRT_PLUGIN_LIB:-$ENGRAM_TRT_GPU_BUILD/libengram_trt_plugins.so}
if [ ! -f "$LIB" ]; then
  echo "no library at $LIB (the build failed: $OUT/build.log)"; exit 3
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
set -o pipefail
ENGRAM_TRT_PLUGIN_LIB=$LIB timeout -s INT -k 20 "${BENCH_TIMEOUT:-300}" \
  python3 benchmarks/kernels/bench_quant.py --quick --json "$OUT/bench_quant.json" 2>&1 | tee "$OUT/bench_quant.log"
BENCH=$?
[ "$TESTS" -ne 0 ] && exit "$TESTS"
exit "$BENCH"
