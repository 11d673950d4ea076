"""``engram-trt triton-repo`` and ``engram-trt serve``: Triton Inference Server.

``triton-repo`` writes the model repository (:mod:`engram_trt.triton.repo`); ``serve``
writes one (to a temp folder unless ``--repo``), starts a real ``tritonserver`` on it
(:mod:`engram_trt.triton.server`), waits until the model is ready, prints the
endpoints, and on SIGINT/SIGTERM forwards the signal, waits for the server to exit and
removes what it wrote in temp folders. Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from engram_trt.cli.output import print_json
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)


def add_repo_arguments(p: argparse.ArgumentParser) -> None:
    """The model's options, shared by ``triton-repo`` and ``serve``."""
    from engram_trt.cli.engram_args import add_engram_config_arguments

    p.add_argument(
        "engine_dir", metavar="ENGINE_DIR", help="engine folder from `engram-trt build` (a checkpoint folder works too)"
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="model instances (each its own process and engram_trt.LLM); with --gpus, per listed GPU. Several "
        "instances share one copy of the Engram tables (dp_shared_memory on by default); with --tp/--dp "
        "use --dp instead (default: %(default)s)",
    )
    p.add_argument(
        "--gpus",
        default=None,
        metavar="0,1",
        help="place instances on these GPUs (instance_group KIND_GPU, --instances on each); with --tp N --dp M, "
        "instance i leads the GPUs at positions i*N..i*N+N-1 of this list, which must hold N x M; default: "
        "KIND_CPU instances that use --device",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "tensorrt", "torch"),
        default="auto",
        help="'tensorrt' runs the engine, 'torch' the reference model (with the project's CUDA kernels on a GPU), "
        "'auto' the first that can run where the instance runs (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="device of KIND_CPU instances: 'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available); with "
        "--tp/--dp, 'auto'/'cuda' place the ranks on this machine's GPUs (KIND_GPU) and 'cpu' (or no CUDA "
        "under 'auto') runs them as CPU processes (default: %(default)s)",
    )
    from engram_trt.config.dtypes import CANONICAL, METAVAR, SPELLINGS, dtype_arg

    p.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=CANONICAL,
        metavar=METAVAR,
        default=None,
        help=f"compute dtype of the torch backend (default: fp32 on CPU, bf16 on CUDA); every subcommand "
        f"takes the spellings {SPELLINGS}",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="KV-cache slots, i.e. requests generating at once per instance (default: the engine's)",
    )
    p.add_argument(
        "--max-seq-len", type=int, default=None, help="tokens per KV slot, prompt + output (default: the engine's)"
    )
    p.add_argument(
        "--max-num-tokens", type=int, default=None, help="token budget of one scheduler step (default: the engine's)"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="max_tokens of a request that does not send one (default: %(default)s)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing repository folder, only if engram-trt wrote it and it holds nothing else",
    )
    p.add_argument(
        "--allow-unused-weights",
        action="store_true",
        help="serve a checkpoint that holds tensors the model does not read (refused by default, naming them: "
        "a model that skipped them might not be the one the checkpoint declares)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the repository, or the endpoints once ready)"
    )
    add_engram_config_arguments(p)
    from engram_trt.cli.distributed import add_parallel_arguments

    add_parallel_arguments(p, serving=True)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_repo_arguments(p)
    p.add_argument(
        "--repo",
        default=None,
        metavar="DIR",
        help="write the model repository here and keep it (default: a temp folder removed at exit)",
    )
    p.add_argument(
        "--address",
        default="0.0.0.0",
        help="address the HTTP, gRPC and metrics endpoints listen on (default: %(default)s, all interfaces; "
        "127.0.0.1 for this machine only)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="HTTP/REST port, with generate and generate_stream; 0 picks a free port (default: %(default)s)",
    )
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port; 0 picks a free port (default: %(default)s)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8002,
        help="Prometheus metrics port (Triton's and the engram_* metrics); 0 picks a free port (default: %(default)s)",
    )
    p.add_argument(
        "--tritonserver",
        default=None,
        metavar="PATH",
        help="the tritonserver binary (default: the one on PATH, else the one the nvidia-pytriton wheel ships)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the model to load (tables included) before giving up (default: %(default)s)",
    )
    p.add_argument(
        "--exit-timeout",
        type=int,
        default=30,
        help="seconds tritonserver waits for in-flight requests at shutdown (default: %(default)s)",
    )
    p.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="write tritonserver's log here (default: this command's stderr)",
    )
    p.add_argument(
        "--triton-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to tritonserver as is, e.g. --triton-arg=--log-verbose=1 (repeat for several)",
    )


def cmd_triton_repo(args: argparse.Namespace) -> int:
    from engram_trt.triton.repo import describe, resolve_options, write_model_repository

    if not args.out:
        raise EngramError("triton-repo needs --out REPO (the folder to write the model repository to)")
    opts = resolve_options(options_from_args(args))
    repo = write_model_repository(opts, args.out, force=args.force)
    info = describe(opts, repo)
    if args.json:
        print_json(info)
    else:
        print(
            f"wrote {repo}: model {info['model']} ({', '.join(info['files'][:2])}), {info['instances']} instance(s) "
            f"{_placement(opts)}"
        )
        if info["engram_config"]:
            print(f"engram config: {info['engram_config']}")
        print(
            f"serve it: tritonserver --model-repository {shlex.quote(str(repo))}   "
            f"(or: engram-trt serve {shlex.quote(str(opts.engine_dir))})"
        )
    return 0


def _placement(opts: Any) -> str:
    """Where the instances run, in words."""
    if opts.tp > 1:
        where = (
            ("on GPUs " + " ".join("[" + ",".join(map(str, g)) + "]" for g in opts.tp_groups))
            if opts.tp_groups
            else "on KIND_CPU (gloo ranks)"
        )
        return f"each leading a TP group of {opts.tp} ranks {where}"
    if opts.parallel and opts.tp_groups:
        return f"on GPUs {','.join(str(g[0]) for g in opts.tp_groups)}"
    return f"on GPUs {','.join(map(str, opts.gpus))}" if opts.gpus else "on KIND_CPU"


class _Signals:
    """SIGINT/SIGTERM recorded (not raised) so the server is stopped in order: the
    signal forwarded, the exit awaited, the temp folder removed."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.event = threading.Event()
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        self.event.set()

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def cmd_serve(args: argparse.Namespace) -> int:
    from engram_trt.triton import server as ts
    from engram_trt.triton.repo import resolve_options, write_model_repository

    opts = resolve_options(options_from_args(args))
    if args.ready_timeout <= 0 or args.exit_timeout < 0:
        raise EngramError("--ready-timeout must be > 0 and --exit-timeout >= 0")
    ports = ts.pick_ports(args.address, {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port})
    install = ts.find_tritonserver(args.tritonserver)
    ts.check_python_for(install)
    workdir = Path(tempfile.mkdtemp(prefix="engram-trt-serve-"))
    log_file = None
    server = None
    try:
        log_file = open(args.log_file, "a") if args.log_file else None
        repo = write_model_repository(
            opts,
            Path(args.repo) if args.repo else workdir / "repo",
            force=args.force,
            flag="--repo" if args.repo else "the temporary repository",
        )
        with _Signals() as sigs:
            server = ts.start_server(
                install,
                repo,
                workdir,
                address=args.address,
                ports=ports,
                exit_timeout=args.exit_timeout,
                extra_args=args.triton_arg,
                log_sink=log_file or sys.stderr,
            )
            if server.wait_ready(args.ready_timeout, lambda: sigs.received is not None):
                _announce(server, opts, args, workdir)
                while not sigs.event.wait(0.5):
                    if server.proc.poll() is not None:
                        break
            if sigs.received is not None:
                rc = server.stop(sigs.received, timeout=args.exit_timeout + 30)
                log.info("tritonserver stopped (exit %s)", rc)
                return 0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else 1
            rc = server.proc.wait()
            server.stop()
            print(
                f"engram-trt: error: tritonserver exited ({rc}) on its own: {server.failure_reason()}", file=sys.stderr
            )
            return 1
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop(timeout=args.exit_timeout + 30)
        shutil.rmtree(workdir, ignore_errors=True)  # ours: the temp repo and backend folder
        if log_file is not None:
            log_file.close()


def _announce(server: Any, opts: Any, args: argparse.Namespace, workdir: Path) -> None:
    from engram_trt.triton import MODEL_NAME
    from engram_trt.triton.server import server_version

    ep = server.endpoints()
    info = {
        **ep,
        "model": MODEL_NAME,
        "repo": str(server.repo),
        "repo_is_temporary": not args.repo,
        "tritonserver": str(server.install.binary),
        "tritonserver_source": server.install.source,
        "tritonserver_version": server_version(server),
        "pid": server.proc.pid,
        "instances": opts.total_instances,
        "tp": opts.tp,
        "dp": opts.total_instances,
        "tp_groups": [list(g) for g in opts.tp_groups],
        "engine_dir": str(opts.engine_dir),
    }
    if args.json:
        print_json(info)
    else:
        print(
            f"{MODEL_NAME} ready: tritonserver {info['tritonserver_version'] or '?'} ({server.install.source}), "
            f"{opts.total_instances} instance(s) {_placement(opts)}, engine {opts.engine_dir}"
        )
        print(f"  HTTP     {ep['http']}   POST /v2/models/{MODEL_NAME}/generate, /generate_stream")
        print(f"  gRPC     {ep['grpc']}")
        print(f"  metrics  {ep['metrics']}")
        print("stop with Ctrl-C (SIGINT) or SIGTERM")
    sys.stdout.flush()


def options_from_args(args: Any, gpus: Any = None) -> Any:
    """RepoOptions of parsed ``triton-repo`` / ``serve`` arguments."""
    from engram_trt.cli.engram_args import engram_config_from_args
    from engram_trt.triton.repo import RepoOptions, parse_gpus

    return RepoOptions(
        engine_dir=Path(args.engine_dir),
        instances=args.instances,
        gpus=tuple(gpus) if gpus is not None else parse_gpus(args.gpus),
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        engram_config=engram_config_from_args(args),
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        default_max_tokens=args.default_max_tokens,
        tp=getattr(args, "tp", 1),
        dp=getattr(args, "dp", 1),
        allow_unused_weights=getattr(args, "allow_unused_weights", False),
    )
