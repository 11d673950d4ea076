#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Target 1's cold lookups on each kind of host page, in one process after another:
# transparent huge pages, 4 KiB pages, then reserved 1 GiB pages (as root). JSON in $OUT.
#
# Why this order: on a fresh start of the H200 VM only 2 of 26 1 GiB pages could be
# reserved, and all 26 once a run had touched ~50 GiB of memory and freed it. So the 1 GiB
# reservation comes after the other two runs, and if it still falls short, after touching
# 64 GiB once more. Extra flags for benchmarks/lookup/bench_gather.py come as arguments.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
G=/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
NEED=${GIGA_PAGES:-26}
python3 benchmarks/lookup/bench_gather.py --pages thp "$@" --json "$OUT/gather_thp.json"
python3 benchmarks/lookup/bench_gather.py --pages 4k "$@" --json "$OUT/gather_4k.json"
echo "$NEED" > "$G"
if [ "$(cat "$G")" -lt "$NEED" ]; then
  echo "1 GiB pages reserved: $(cat "$G") of $NEED; touching 64 GiB and trying again"
  echo 0 > "$G"
  python3 -c "import numpy as np; a = np.ones(64 << 30, dtype=np.uint8); print('touched', a.nbytes >> 30, 'GiB')"
  echo "$NEED" > "$G"
fi
echo "1 GiB pages reserved: $(cat "$G") of $NEED"
python3 benchmarks/lookup/bench_gather.py --pages 1g "$@" --json "$OUT/gather_1g.json"
echo 0 > "$G"
