#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One short GPU run of every script here that was an `engram-trt bench` command (issue 44
# item 5 moved them out of the package): small tables and few repetitions, so each takes
# seconds; a script passes when it exits 0 and writes its JSON. The figures of a smoke
# run are no measurement (the full runs: benchmarks/README.md).
#
#   OUT=/some/folder bash benchmarks/smoke_gpu.sh
#
# $OUT receives NAME.json and NAME.log per script and smoke.txt (one line per script:
# its exit status). Exit status: the number of scripts that failed. The kernel library is
# the one engram_trt finds ($ENGRAM_TRT_PLUGIN_LIB, the package's lib/, build/).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench-smoke}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
K=benchmarks/kernels
L=benchmarks/lookup
# a token file without the tokenizer: a Zipf stream, as tests/bench/test_bench_lookup.py makes one
python3 - "$OUT/tokens.npz" <<'PY'
import sys
import numpy as np
sys.path.insert(0, "benchmarks/lookup")
import idstreams
ids = (np.random.default_rng(0).zipf(1.3, size=8192 * 6 + 5) % 99092).astype(np.int32)
idstreams.save_tokens(idstreams.TokenStream(ids=ids, compressed_vocab_size=99092, pad_id=1, text_bytes=4 * ids.size,
                                            num_files=1, python="-", tokenizer_sha256="-", files_sha256="-"), sys.argv[1])
PY
FAILED=0
: > "$OUT/smoke.txt"
run() {  # NAME SCRIPT ARGS...: the script with --json $OUT/NAME.json
  local name=$1 script=$2
  shift 2
  timeout -s INT -k 20 "${SMOKE_TIMEOUT:-300}" python3 "$script" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  record "$name" $?
}
record() {  # NAME STATUS: a pass needs status 0 and the JSON written
  local status=$2
  if [ "$status" -eq 0 ] && [ ! -s "$OUT/$1.json" ]; then status="0 (no JSON)"; fi
  [ "$status" = 0 ] || FAILED=$((FAILED + 1))
  echo "$1 $status" | tee -a "$OUT/smoke.txt"
}
run gemv $K/bench_gemv.py --shapes qkv,down --tokens 1,4 --iters 3
run kernels $K/bench_kernels.py --table-gib 1 --reps 3
run attention $K/bench_attention.py --reps 3 --cases "decode 64 x 256"
run backbone $K/bench_backbone.py --iters 3 --batches 1 --context 128
run gather $L/bench_gather.py --table-gib 1 --rows 6144 --threads 8 --reps 3 --paths uva,host,split,torch --layouts split,hbm-scales
run ple-gather $L/bench_ple_gather.py --table-gib 1 --hbm-gib 1 --decode 64 --prefill 1024 --reps 3
run gathersweep $L/bench_gathersweep.py --table-gib 1 --reps 3
run contention $L/bench_contention.py --table-gib 1 --reps 2
run cacheplan $L/bench_cacheplan.py --plan-reps 2 --fetch-reps 2
run cache $L/bench_cache.py --tokens "$OUT/tokens.npz" --column-rows 65536 --layers 0 --warm 2 --measure 2
python3 $L/idstreams.py --tokens "$OUT/tokens.npz" --column-rows 65536 --stats-chunks 2 --json \
  > "$OUT/idstream.json" 2> "$OUT/idstream.log"  # its --json prints
record idstream $?
exit "$FAILED"
