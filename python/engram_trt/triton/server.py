"""Starting a real ``tritonserver`` on a model repository, and stopping it.

Which server: ``--tritonserver PATH`` when given, else the one on ``PATH`` (a Triton
install or container), else the one the PyPI wheel ``nvidia-pytriton`` ships
(``pytriton/tritonserver/bin/tritonserver`` with the Python backend and one backend stub
per Python version; it runs on CPU-only machines, where its NVML/DCGM warnings are
harmless). For that wheel's server this module lays out a backend folder in a temp
folder: the Python backend's library and utils beside the stub built for *this*
interpreter's Python version, as the backend expects them, and sets the environment so
the stub embeds this interpreter (its libpython on ``LD_LIBRARY_PATH``, ``PYTHONHOME``,
and this interpreter's folder first on ``PATH``, which is how the stub finds a
virtual environment) instead of the system Python it was linked against.

Readiness is Triton's own: ``GET /v2/models/engram_llm/ready`` on the HTTP port
answers 200 once the model has loaded. A server that exits first is reported with
the reason it logged (the model's load error, a port it could not bind).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import importlib.metadata
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from engram_trt.errors import EngramError
from engram_trt.triton import MODEL_NAME

log = logging.getLogger(__name__)

PIP_HINT = "python3 -m pip install 'nvidia-pytriton==0.7.0'"
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


@dataclass(frozen=True)
class TritonInstall:
    """A ``tritonserver`` binary and what it needs to run here."""

    binary: Path
    source: str  # 'given' | 'PATH' | 'nvidia-pytriton'
    python_backend: Path | None = None  # the wheel's backends/python folder (None: the server's default)
    stub: Path | None = None  # the wheel's stub for this Python version
    lib_dir: Path | None = None  # the wheel's bundled libraries

    @property
    def bundled(self) -> bool:
        return self.python_backend is not None


def _pytriton_root() -> Path | None:
    """The installed ``pytriton`` package folder, found without importing it."""
    try:
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_tritonserver(explicit: str | None = None) -> TritonInstall:
    """See the module docstring; one-line refusal naming the install command."""
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise EngramError(f"--tritonserver '{p}' is not an executable file")
        return TritonInstall(p.resolve(), "given")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path).resolve(), "PATH")
    root = _pytriton_root()
    if root is None or not (root / "tritonserver" / "bin" / "tritonserver").is_file():
        raise EngramError(
            "no tritonserver found: none on PATH and the nvidia-pytriton wheel (which ships one) is not installed; "
            f"install it with `{PIP_HINT}` (or `pip install 'engram-trt[serve]'`), or pass --tritonserver PATH"
        )
    dist = root / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = (
            sorted(p.name for p in (dist / "python_backend_stubs").iterdir())
            if (dist / "python_backend_stubs").is_dir()
            else []
        )
        raise EngramError(
            f"nvidia-pytriton ships Python-backend stubs for Python {', '.join(have) or 'no version'}, "
            f"not for this Python {version}; serve with one of those"
        )
    lib_dir = root.parent / "nvidia_pytriton.libs"
    if not lib_dir.is_dir():
        lib_dir = dist / "external_libs"  # an editable install of pytriton
    return TritonInstall(
        dist / "bin" / "tritonserver",
        "nvidia-pytriton",
        dist / "backends" / "python",
        stub,
        lib_dir if lib_dir.is_dir() else None,
    )


def check_python_for(install: TritonInstall) -> None:
    """The wheel's stub (Triton 2.51's pybind11) misreads NumPy 2 arrays: refuse it
    before the server starts, with the fix (the wheel itself pins numpy<2)."""
    if not install.bundled:
        return
    try:
        major = int(importlib.metadata.version("numpy").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return
    if major >= 2:
        raise EngramError(
            f"the tritonserver of nvidia-pytriton runs its Python backend with NumPy 1 only, but this Python "
            f"has numpy {importlib.metadata.version('numpy')}; install `python3 -m pip install 'numpy<2'` "
            "(what nvidia-pytriton asks for), or serve with a tritonserver built for NumPy 2 (--tritonserver)"
        )


def prepare_backends(install: TritonInstall, workdir: Path) -> Path | None:
    """The ``--backend-directory`` for the wheel's server (see the module docstring),
    or None for a server with its own backends."""
    if not install.bundled:
        return None
    assert install.python_backend is not None and install.stub is not None
    py = workdir / "backends" / "python"
    py.mkdir(parents=True, exist_ok=True)
    for f in install.python_backend.iterdir():
        if f.is_file():
            shutil.copy2(f, py / f.name)
    shutil.copy2(install.stub, py / "triton_python_backend_stub")
    return workdir / "backends"


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: for the wheel's server, its libraries and this
    interpreter's libpython on LD_LIBRARY_PATH, PYTHONHOME, and this interpreter first on
    PATH (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    if not install.bundled:
        return env
    libs = [str(install.lib_dir)] if install.lib_dir else []
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        libs.append(libdir)
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PYTHONHOME"] = sys.base_prefix
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def pick_port(address: str, port: int, flag: str) -> int:
    """``port``, checked free on ``address``; 0 picks a free one."""
    if not 0 <= port <= 65535:
        raise EngramError(f"{flag} {port} is not a port number (0..65535; 0 picks a free port)")
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise EngramError(
                    f"{flag} {port}: the port is in use on {address}; pick another port "
                    "(0 picks a free one) or stop what holds it"
                ) from None
            raise EngramError(f"{flag} {port}: cannot bind {address}:{port} ({exc.strerror})") from None
        return int(s.getsockname()[1])


def check_address(address: str) -> None:
    """``--address``: an IP address of this machine (or a wildcard), or a host name that
    resolves to one; refused in one line that blames the address, not a port."""
    fix = "use 0.0.0.0 (all interfaces), 127.0.0.1 (this machine only) or one of this machine's addresses"
    if address == "":
        return  # all interfaces, as 0.0.0.0
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise EngramError(
            f"--address {address!r} is not an IP address or a host name this machine resolves ({why}); {fix}"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((sockaddr[0], 0))
        except OSError as exc:
            raise EngramError(
                f"--address {address!r}: cannot listen there ({exc.strerror}: not an address of this machine?); {fix}"
            ) from None


def pick_ports(address: str, wanted: dict[str, int]) -> dict[str, int]:
    """All three ports checked (and picked for 0), distinct; the address first."""
    check_address(address)
    got: dict[str, int] = {}
    for name, port in wanted.items():
        for _ in range(20):
            p = pick_port(address, port, f"--{name}-port")
            if p not in got.values():
                break
            if port != 0:
                raise EngramError(f"--{name}-port {port} is already given to another endpoint; use distinct ports")
        got[name] = p
    return got


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the serving process dies without stopping us."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class TritonServer:
    """A started ``tritonserver`` (see :func:`start_server`)."""

    proc: subprocess.Popen
    install: TritonInstall
    address: str
    ports: dict[str, int]
    repo: Path
    log_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=400))
    _reader: threading.Thread | None = None

    @property
    def host(self) -> str:
        """Where a local client connects (a wildcard address is reached on loopback)."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.address, self.address)

    def endpoints(self) -> dict[str, str]:
        h = f"[{self.host}]" if ":" in self.host else self.host
        http = f"http://{h}:{self.ports['http']}"
        return {
            "http": http,
            "grpc": f"{h}:{self.ports['grpc']}",
            "metrics": f"http://{h}:{self.ports['metrics']}/metrics",
            "generate": f"{http}/v2/models/{MODEL_NAME}/generate",
            "generate_stream": f"{http}/v2/models/{MODEL_NAME}/generate_stream",
        }

    def _read(self, sink: TextIO | None) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.log_tail.append(line.rstrip("\n"))
            if sink is not None:
                try:
                    sink.write(line)
                    sink.flush()
                except (OSError, ValueError):
                    sink = None

    def failure_reason(self) -> str:
        """The most telling line of the server's log (a model's load error first)."""
        lines = list(self.log_tail)
        for ln in reversed(lines):
            m = re.search(r"failed to load '[^']+' version \d+: (?:Internal: )?(.*)", ln)
            if m:  # Triton logs the model's exception with its traceback as literal "\n"s
                return "the model failed to load: " + m.group(1).split("\\n")[0].strip().rstrip('"')
        for key in ("failed to load", "Failed to initialize", "EngramError", "already in use", "error:", "Error"):
            hits = [ln for ln in lines if key in ln]
            if hits:
                return " ".join(hits[-1].split())[-600:]
        return " ".join(lines[-1].split())[-600:] if lines else "(no output)"

    def wait_ready(self, timeout: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Until the model answers ready (True) or ``should_stop()`` (False); refused when
        the server exits or time runs out."""
        url = (
            f"http://{'[' + self.host + ']' if ':' in self.host else self.host}:{self.ports['http']}"
            f"/v2/models/{MODEL_NAME}/ready"
        )
        deadline = time.monotonic() + timeout
        while not should_stop():
            rc = self.proc.poll()
            if rc is not None:
                if self._reader is not None:
                    self._reader.join(timeout=5)
                raise EngramError(f"tritonserver exited ({rc}) before {MODEL_NAME} was ready: {self.failure_reason()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngramError(
                    f"{MODEL_NAME} was not ready within {timeout:.0f} s (--ready-timeout); last server "
                    f"log line: {self.failure_reason()}"
                )
            time.sleep(0.25)
        return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Forward ``sig``, wait for the exit (SIGKILL after ``timeout``); the exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop within %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return int(self.proc.returncode)


def start_server(
    install: TritonInstall,
    repo: Path,
    workdir: Path,
    *,
    address: str,
    ports: dict[str, int],
    exit_timeout: int = 30,
    extra_args: Sequence[str] = (),
    log_sink: TextIO | None = None,
) -> TritonServer:
    """Start ``tritonserver`` on ``repo`` (its output goes to ``log_sink`` and a tail
    is kept for error messages); returns at once: call :meth:`TritonServer.wait_ready`."""
    backends = prepare_backends(install, workdir)
    cmd = [
        str(install.binary),
        f"--model-repository={repo}",
        f"--http-address={address}",
        f"--http-port={ports['http']}",
        f"--grpc-address={address}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-address={address}",
        f"--metrics-port={ports['metrics']}",
        f"--exit-timeout-secs={exit_timeout}",
        # One shared-memory prefix per server, so two servers on a node never collide.
        f"--backend-config=python,shm-region-prefix-name=engram{os.getpid()}x{ports['http']}",
    ]
    if backends is not None:
        cmd.append(f"--backend-directory={backends}")
    cmd += list(extra_args)
    log.info("starting %s", " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        env=server_env(install),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    server = TritonServer(proc, install, address, ports, repo)
    server._reader = threading.Thread(target=server._read, args=(log_sink,), name="tritonserver-log", daemon=True)
    server._reader.start()
    return server


def server_version(server: TritonServer) -> str | None:
    """Triton's version, from its HTTP metadata (None when it does not answer)."""
    import json

    try:
        with urllib.request.urlopen(f"http://{server.host}:{server.ports['http']}/v2", timeout=5) as r:
            return json.loads(r.read()).get("version")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def describe_install(install: TritonInstall) -> dict[str, Any]:
    return {"tritonserver": str(install.binary), "source": install.source}
