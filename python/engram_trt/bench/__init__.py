"""``engram-trt bench``: benchmarks that print ratios against a limit or a baseline
measured in the same run (never a bare time), with ``--json`` for scripts.

Each subcommand is a module with an ``<Name>Options`` dataclass (every flag a typed
field, its help in the field's metadata: :func:`engram_trt.bench.options.opt`) and
``run(opts) -> int``; the command line (:mod:`engram_trt.cli.bench`) derives the flags
from the dataclass and lists the subcommands in one table. No argparse here, and no
torch at import: each ``run`` imports what it needs when it runs.

- ``bench gather``: cold lookups from a >= 24 GiB host table (UVA kernel, host gather in
  split / inline layouts, torch.index_select + copy) against the link (gather.py);
- ``bench cache``: real row-id streams through per-step de-duplication and the HBM
  hot-row cache against the cold host gather, host layouts side by side in one process
  (cache.py, its runs cacherun.py, its report cachereport.py);
- ``bench idstream``: the token file of real text those streams come from (idstreams.py);
- ``bench rowcounts``: per-row lookup counts of a range of that text, a cache's warm start (rowcounts.py);
- ``bench step``: step time with Engram (GPU / pinned tables) over the step without it (step.py);
- ``bench serve``: throughput of N concurrent requests through LLM over one request (serve.py);
- ``bench gemv``: a decode step's projections, the kernel library's GEMV vs the GEMM library, over HBM (gemv.py);
- ``bench kernels``: gate vs a device copy, the hash vs its 20 us target, the gather paths on a 24 GiB
  table vs the host-to-device copy (kernels.py);
- ``bench attention``: packed attention vs torch SDPA, the tiled kernel and the K/V read at the HBM rate (attention.py);
- ``bench backbone``: the 1.15B model's decode steps, fused vs unfused and variants, vs the weight-read bound (backbone.py);
- ``bench gathersweep`` / ``bench contention``: the host gather under pool and thread settings, and after each
  contention suspect, vs the link's floor (gathersweep.py, contention.py);
- ``bench cacheplan``: the hot-row cache's fused plan vs its torch reference, the misses' fetch vs the link (cacheplan.py).

The last six need CUDA (they exit with one line without it); the cases they time are
built by gpucases.py, which tests/gpu imports to check the same cases' outputs.
"""
