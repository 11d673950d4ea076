"""``engram-trt bench``: the end-to-end measurements a user runs to size a deployment on
their machine, each printing ratios against a limit or a baseline measured in the same
run (never a bare time), with ``--json`` for scripts.

Each subcommand is a module with an ``<Name>Options`` dataclass (every flag a typed
field, its help in the field's metadata: :func:`engram_trt.bench.options.opt`) and
``run(opts) -> int``; the command line (:mod:`engram_trt.cli.bench`) derives the flags
from the dataclass and lists the subcommands in one table. No argparse here, and no
torch at import: each ``run`` imports what it needs when it runs.

- ``bench serve``: throughput of N concurrent requests through LLM over one request (serve.py);
- ``bench steady``: the steady decode rate ``demo`` / ``run`` print beside bench serve's one stream (steady.py);
- ``bench e2e``: checkpoints transformers made: its generate vs run vs bench serve, vs the weight-read floor
  (e2e.py; ``--breakdown``: breakdown.py);
- ``bench step``: an engram-llama step with the Engram tables in HBM / pinned host memory over the step
  without them (step.py, stepprofile.py);
- ``bench dsv4-step`` / ``bench qwen4-step``: DeepSeek-V4.1 / Qwen4Exp decode steps at published shapes, the
  tables pinned vs HBM, the weight formats, vs the step's floor (dsv4step.py with dsv4model.py and
  dsv4profile.py; qwen4step.py).

The rule (benchmarks/README.md): a whole served model or a whole step of a model under a
choice the runtime offers is a command here; a kernel microbenchmark or a probe of one
effect (the gather paths, the hot-row cache, the GEMV, attention, contention, ...) is a
script under the repository's ``benchmarks/``, outside the wheel, importing this package
as a library (``common.py``'s limits and timers, ``options.py``'s fields among them).
"""
