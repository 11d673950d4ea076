"""The Triton model repository: ``REPO/engram_llm/config.pbtxt`` + ``1/model.py``.

``config.pbtxt`` declares the Python backend, the decoupled transaction policy (tokens
stream as generated), the TensorRT-LLM backend's tensor names (:mod:`.tensors`), the
instance group (count, CPU or the GPUs to place instances on) and, as parameters, what
the model hands :class:`engram_trt.LLM`: the engine folder, backend, device, the
``--engram-config`` fields and the runtime limits. ``1/model.py`` is a shim: it finds
the engram_trt package that wrote the repository (its path is a parameter, used when it
still exists, else the installed package) and delegates to :mod:`.model`.

Several instances on a node share one copy of the Engram tables through the shared
table store (``dp_shared_memory``), which :func:`resolve_engram_config` turns on by
default when more than one instance is configured.

``--tp N --dp M`` (:func:`resolve_parallel`): M instances (replicas), each the leader
of a tensor-parallel group of N ranks that it starts itself
(:mod:`engram_trt.distributed.serving`). On GPUs instance i leads GPUs
``gpus[i*N .. i*N+N-1]`` (``--gpus``, else 0..N*M-1 of this machine): the config
holds one ``KIND_GPU`` group entry per instance on its first GPU, and the
``tp_gpus`` parameter lists every group's GPUs. On a CPU the groups are gloo
processes and any count runs. ``embedding_across_dp`` across instances is refused:
it needs every replica stepping in lockstep, which independent instances do not.

Never losing a user's folder: the repository is written into a new sibling folder and
renamed into place. An existing non-empty ``REPO`` is refused unless ``force``, and even
then only when it is a repository this module wrote (its marker file lists the files
it wrote) holding nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engram_trt import __version__
from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError
from engram_trt.triton import MODEL_NAME
from engram_trt.triton.tensors import INPUTS, OUTPUTS, TensorSpec

log = logging.getLogger(__name__)

MARKER = "engram-trt-repo.json"
BACKENDS = ("auto", "tensorrt", "torch")

MODEL_PY = '''\
"""engram_llm: Triton Python-backend model over engram_trt.LLM (written by `engram-trt triton-repo`).

The implementation lives in the engram_trt package (engram_trt/triton/model.py); this
file only finds that package: the one that wrote this repository when its path (the
'engram_trt_path' parameter) still holds it, else the installed one.
"""

import json
import os
import sys


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = config.get("parameters", {}).get("engram_trt_path", {}).get("string_value", "")
        if path and os.path.isfile(os.path.join(path, "engram_trt", "__init__.py")) and path not in sys.path:
            sys.path.insert(0, path)
        import triton_python_backend_utils as pb_utils
        from engram_trt.triton.model import EngramTritonModel

        self._model = EngramTritonModel(pb_utils, args)

    def execute(self, requests):
        return self._model.execute(requests)

    def finalize(self):
        self._model.finalize()
'''


@dataclass(frozen=True)
class RepoOptions:
    """What goes into config.pbtxt besides the tensors (see the module docstring)."""

    engine_dir: Path
    instances: int = 1
    gpus: tuple[int, ...] = ()
    backend: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    engram_config: EngramConfig = field(default_factory=EngramConfig)
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    default_max_tokens: int = 16
    metrics_interval_s: float = 1.0
    tp: int = 1  # ranks per instance (--tp)
    dp: int = 1  # instances (--dp)
    tp_groups: tuple[tuple[int, ...], ...] = ()  # per instance, its group's GPUs (resolve_parallel fills it)
    allow_unused_weights: bool = (
        False  # serve a checkpoint holding tensors the model does not read (--allow-unused-weights)
    )

    @property
    def parallel(self) -> bool:
        """``--tp`` / ``--dp`` lay the instances out (else ``--instances`` per listed GPU)."""
        return self.tp != 1 or self.dp != 1

    @property
    def total_instances(self) -> int:
        """``--dp`` with ``--tp``/``--dp``; else Triton places ``instances`` per listed GPU."""
        if self.parallel:
            return self.dp
        return self.instances * max(1, len(self.gpus))


def parse_gpus(text: str | None) -> tuple[int, ...]:
    """``--gpus 0,1`` -> (0, 1); refused: non-integers, negatives, repeats."""
    if text is None or not str(text).strip():
        return ()
    try:
        ids = tuple(int(t) for t in str(text).split(","))
    except ValueError:
        raise EngramError(f"--gpus {text!r}: expected comma-separated GPU ids such as 0,1") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise EngramError(f"--gpus {text!r}: GPU ids must be distinct integers >= 0")
    return ids


def check_engine_dir(path: str | Path) -> Path:
    """The engine folder (or checkpoint folder), absolute; refused when it is not one.
    Light on purpose (no torch): the model's load does the full check."""
    p = Path(path).expanduser()
    if not p.exists():
        raise EngramError(
            f"engine folder '{p}' does not exist; build one with `engram-trt build CHECKPOINT --output DIR`"
        )
    if not p.is_dir():
        raise EngramError(f"'{p}' is not a folder; pass an engine folder from `engram-trt build`")
    if not (p / "manifest.json").is_file() and not (p / "config.json").is_file():
        raise EngramError(
            f"'{p}' is neither an engine folder (no manifest.json) nor a checkpoint (no config.json); "
            "build one with `engram-trt build CHECKPOINT --output DIR`"
        )
    return p.resolve()


def resolve_engram_config(cfg: EngramConfig, total_instances: int) -> EngramConfig:
    """With several instances, default ``dp_shared_memory`` on (one table copy per node)
    unless the user chose it, or chose a field it contradicts."""
    if total_instances <= 1 or "dp_shared_memory" in cfg.given:
        cfg.validate()
        return cfg
    shared = cfg.with_overrides({"dp_shared_memory": True})
    try:
        shared.validate()
    except EngramError as exc:
        log.info("several instances but dp_shared_memory stays off: %s", exc)
        cfg.validate()
        return cfg
    return shared


def cuda_device_count() -> int:
    """GPUs torch sees here (0 without torch or CUDA); imported only when a layout needs it."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_parallel(opts: RepoOptions) -> RepoOptions:
    """The ``--tp N --dp M`` layout (see the module docstring): ``tp_groups`` and the
    GPUs used on CUDA, ``device`` 'cpu' for gloo groups. Refused in one line: sizes
    below 1, ``--instances`` beside ``--dp``, fewer GPUs than ``N x M``. Idempotent."""
    tp, dp = opts.tp, opts.dp
    for name, v in (("tp", tp), ("dp", dp)):
        if v < 1:
            raise EngramError(f"--{name} must be >= 1 (got {v})")
    if not opts.parallel:
        return opts
    if opts.instances != 1:
        raise EngramError(
            f"--instances {opts.instances} cannot be combined with --tp/--dp: there --dp M sets the instances "
            f"(each leading --tp N ranks); pass --dp {opts.instances} instead"
        )
    need = tp * dp
    layout = f"--tp {tp} x --dp {dp} needs {need} GPU(s), one per rank,"
    gpus = opts.gpus
    device = opts.device
    if not gpus:
        if device == "cpu":
            return replace(opts, tp_groups=())
        if device.startswith("cuda:"):
            raise EngramError(
                f"--device {device}: with --tp/--dp every rank takes its own GPU; pass --device cuda (or auto), "
                "or --gpus to choose them"
            )
        n = cuda_device_count()
        if n == 0 and device == "auto":
            log.info(
                "no CUDA device here: the %d instance(s) run their TP groups on CPU (gloo); pass --gpus to write a "
                "repository for GPUs elsewhere",
                dp,
            )
            return replace(opts, device="cpu", tp_groups=())
        if n < need:
            raise EngramError(
                f"{layout} but this machine has {n} CUDA device(s); lower --tp/--dp, pass --gpus to write "
                "a repository for another machine, or --device cpu"
            )
        gpus = tuple(range(need))
    if len(gpus) < need:
        raise EngramError(
            f"{layout} but --gpus lists {len(gpus)} ({','.join(map(str, gpus))}); list {need} GPU ids "
            "or lower --tp/--dp"
        )
    if len(gpus) > need:
        log.warning(
            "--gpus lists %d GPUs; --tp %d x --dp %d uses the first %d (%s)",
            len(gpus),
            tp,
            dp,
            need,
            ",".join(map(str, gpus[:need])),
        )
    groups = tuple(tuple(gpus[i * tp : (i + 1) * tp]) for i in range(dp))
    return replace(opts, gpus=tuple(gpus[:need]), tp_groups=groups)


def check_parallel_tables(opts: RepoOptions) -> None:
    """Refuse ``embedding_across_dp`` over several ``--dp`` instances (see the module docstring)."""
    if opts.parallel and opts.dp > 1 and opts.engram_config.embedding_across_dp:
        raise EngramError(
            f"--engram-config embedding_across_dp shards the tables over replicas that step in lockstep, but "
            f"the --dp {opts.dp} Triton instances step independently; drop it (dp_shared_memory, the default "
            "with --dp > 1, keeps one /dev/shm copy per node) or serve --dp 1"
        )


def _q(text: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tensor(t: TensorSpec, opt: bool) -> str:
    dims = ", ".join(str(d) for d in t.dims)
    extra = " optional: true" if opt and t.optional else ""
    return f"  {{ name: {_q(t.name)} data_type: {t.data_type} dims: [ {dims} ]{extra} }}"


def model_parameters(opts: RepoOptions) -> dict[str, str]:
    """The parameters block, as strings (Triton's form); read back by
    :meth:`engram_trt.triton.model.ModelParams.from_model_config`."""
    import engram_trt

    ecfg = opts.engram_config
    given = {k: v for k, v in ecfg.to_dict().items() if k in ecfg.given}
    params = {
        "engine_dir": str(opts.engine_dir),
        "engram_trt_path": str(Path(engram_trt.__file__).resolve().parent.parent),
        "backend": opts.backend,
        "device": opts.device,
        "dtype": opts.dtype or "",
        "engram_config": json.dumps(given, sort_keys=True) if given else "",
        "max_batch_size": "" if opts.max_batch_size is None else str(opts.max_batch_size),
        "max_seq_len": "" if opts.max_seq_len is None else str(opts.max_seq_len),
        "max_num_tokens": "" if opts.max_num_tokens is None else str(opts.max_num_tokens),
        "default_max_tokens": str(opts.default_max_tokens),
        "metrics_interval_s": str(opts.metrics_interval_s),
        "tp": str(opts.tp),
        "dp": str(opts.total_instances),
        "tp_gpus": ";".join(",".join(str(g) for g in grp) for grp in opts.tp_groups),
        "allow_unused_weights": "true" if opts.allow_unused_weights else "false",
    }
    return params


def config_pbtxt(opts: RepoOptions) -> str:
    """config.pbtxt of the ``engram_llm`` model."""
    if opts.parallel and opts.tp_groups:  # one entry per instance, on its group's first GPU
        group = ",\n".join(f"  {{ count: 1 kind: KIND_GPU gpus: [ {g[0]} ] }}" for g in opts.tp_groups)
    elif opts.parallel:
        group = f"  {{ count: {opts.dp} kind: KIND_CPU }}"
    elif opts.gpus:
        group = f"  {{ count: {opts.instances} kind: KIND_GPU gpus: [ {', '.join(str(g) for g in opts.gpus)} ] }}"
    else:
        group = f"  {{ count: {opts.instances} kind: KIND_CPU }}"
    lines = [
        f"# engram_llm over engram_trt.LLM; written by engram-trt {__version__} (`engram-trt triton-repo`).",
        "# Tensor names follow the TensorRT-LLM backend. max_batch_size 1: one prompt per request,",
        "# concurrent requests are batched by engram-trt's scheduler (the model is decoupled).",
        f"name: {_q(MODEL_NAME)}",
        'backend: "python"',
        "max_batch_size: 1",
        "model_transaction_policy { decoupled: true }",
        "input [",
        ",\n".join(_tensor(t, True) for t in INPUTS),
        "]",
        "output [",
        ",\n".join(_tensor(t, False) for t in OUTPUTS),
        "]",
        "instance_group [",
        group,
        "]",
    ]
    for key, value in model_parameters(opts).items():
        lines.append(f"parameters {{ key: {_q(key)} value: {{ string_value: {_q(value)} }} }}")
    return "\n".join(lines) + "\n"


def _check_options(opts: RepoOptions) -> None:
    if opts.instances < 1:
        raise EngramError(f"--instances must be >= 1 (got {opts.instances})")
    if opts.backend not in BACKENDS:
        raise EngramError(f"--backend must be one of {', '.join(BACKENDS)} (got {opts.backend!r})")
    if opts.gpus and opts.device not in ("auto", "cuda"):
        raise EngramError(f"--gpus places instances on GPUs, which contradicts --device {opts.device}; drop one")
    if opts.default_max_tokens < 1:
        raise EngramError(f"--default-max-tokens must be >= 1 (got {opts.default_max_tokens})")
    for name in ("max_batch_size", "max_seq_len", "max_num_tokens"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise EngramError(f"--{name.replace('_', '-')} must be >= 1 (got {v})")


def _our_files(out: Path) -> set[str]:
    """The files an existing repository's marker says we wrote (empty: not ours)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(marker, dict) or marker.get("written_by") != "engram-trt":
        return set()
    return {str(f) for f in marker.get("files", [])} | {MARKER}


def _check_replaceable(out: Path, force: bool, flag: str = "--out") -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise EngramError(f"{flag} '{out}' exists and is not a folder; choose a new folder")
    present = [p for p in out.rglob("*") if p.is_file() or p.is_symlink()]
    if not present and not any(out.iterdir()):
        return
    if not force:
        raise EngramError(
            f"{flag} '{out}' exists and is not empty; choose a new folder, or pass --force to replace "
            "a repository engram-trt wrote there"
        )
    ours = _our_files(out)
    if not ours:
        raise EngramError(
            f"{flag} '{out}' is not a model repository engram-trt wrote (no {MARKER}); refusing to "
            "replace it, even with --force; choose a new folder"
        )
    for p in present:
        rel = p.relative_to(out).as_posix()
        if rel not in ours and "__pycache__" not in p.parts:
            raise EngramError(
                f"{flag} '{out}' holds '{rel}', which engram-trt did not write; refusing to replace it; "
                "move it away or choose a new folder"
            )


def resolve_options(opts: RepoOptions) -> RepoOptions:
    """Checked options: the engine folder absolute, the Engram config with its
    several-instance default (idempotent)."""
    from engram_trt.distributed.support import check_parallel_support
    from engram_trt.runtime.engine_folder import peek_model

    _check_options(opts)
    engine_dir = check_engine_dir(opts.engine_dir)
    peek = check_parallel_support(engine_dir, opts.tp, opts.dp, opts.engram_config, serving=True)
    opts = resolve_parallel(opts)
    if opts.tp_groups or opts.gpus:  # a model larger than this TP's GPUs: said before any instance loads
        from engram_trt.distributed.support import check_gpu_fit, gpu_memory_bytes

        first = opts.tp_groups[0][0] if opts.tp_groups else opts.gpus[0]
        check_gpu_fit(engine_dir, opts.tp, opts.dtype, gpu_memory_bytes(first), f"GPU {first}")
    if peek is None and opts.total_instances > 1:
        peek = peek_model(engine_dir)
    ecfg = opts.engram_config
    if peek is None or peek.has_tables:  # a model without tables has nothing to share
        ecfg = resolve_engram_config(ecfg, opts.total_instances)
    else:
        ecfg.validate()
    opts = replace(opts, engine_dir=engine_dir, engram_config=ecfg)
    check_parallel_tables(opts)
    return opts


def write_model_repository(opts: RepoOptions, out: str | Path, *, force: bool = False, flag: str = "--out") -> Path:
    """Write the repository to ``out`` (see the module docstring); returns its path."""
    opts = resolve_options(opts)
    from engram_trt.storage import atomic

    out = atomic.writable_output(out, flag)  # a link written through; a mount point refused
    _check_replaceable(out, force, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = {f"{MODEL_NAME}/config.pbtxt": config_pbtxt(opts), f"{MODEL_NAME}/1/model.py": MODEL_PY}
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        marker = {
            "written_by": "engram-trt",
            "version": __version__,
            "model": MODEL_NAME,
            "engine_dir": str(opts.engine_dir),
            "files": sorted(files),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        if out.exists() and any(out.iterdir()):
            # Ours (checked above): move it aside, put the new one in place, then drop it.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "repo")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)  # replaces an empty folder atomically
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote Triton model repository %s (model %s, %d instance(s))", out, MODEL_NAME, opts.total_instances)
    return out


def describe(opts: RepoOptions, repo: Path) -> dict[str, Any]:
    """What ``triton-repo --json`` prints (``opts`` as :func:`resolve_options` returns them)."""
    return {
        "repo": str(repo),
        "model": MODEL_NAME,
        "engine_dir": str(opts.engine_dir),
        "instances": opts.total_instances,
        "instance_kind": "KIND_GPU" if opts.gpus else "KIND_CPU",
        "gpus": list(opts.gpus),
        "tp": opts.tp,
        "dp": opts.total_instances,
        "tp_groups": [list(g) for g in opts.tp_groups],
        "engram_config": json.loads(model_parameters(opts)["engram_config"] or "{}"),
        "files": [f"{MODEL_NAME}/config.pbtxt", f"{MODEL_NAME}/1/model.py", MARKER],
    }
