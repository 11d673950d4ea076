"""Never lose a user's file: refusals before writing, builds that swap in whole folders,
kill -9 at named points, concurrent builds, and the cleanup of dead processes' temporaries."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.checkpoints import make_tiny_checkpoint
from helpers.files import REPO, file_sha256, tree_digest
from engram_trt.storage import atomic
from engram_trt.builder.build import build
from engram_trt.cli.main import main
from engram_trt.errors import EngramError


def env_for_subprocess(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        ENGRAM_TRT_NO_PROGRESS="1",
    )
    env.update(extra)
    return env


def cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engram_trt", *argv],
        capture_output=True,
        text=True,
        env=env_for_subprocess(**env),
        timeout=300,
    )


def temps_beside(target: Path) -> list[str]:
    """Temporaries and markers of ``target`` (lock files are not temporaries)."""
    return sorted(
        p.name
        for p in target.parent.iterdir()
        if p.name.startswith(f".{target.name}.") and not p.name.endswith(atomic.LOCK_SUFFIX)
    )


@pytest.fixture
def engine(tmp_path: Path, tiny_ckpt: Path) -> Path:
    """A good engine folder of the tiny checkpoint (graph only), with a user's note in it."""
    out = tmp_path / "eng"
    build(tiny_ckpt, out, build_engine_if_possible=False, progress=False)
    (out / "NOTES.txt").write_text("the user's own notes\n")
    return out


# ---------------------------------------------------------------- demo-checkpoint OUT
def test_demo_checkpoint_refuses_an_existing_checkpoint(tmp_path: Path, tiny_ckpt: Path, capsys) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    before = tree_digest(ck)
    code = main(["demo-checkpoint", str(ck)])
    err = capsys.readouterr().err
    assert code == 2 and "is not empty" in err and "--force" in err and err.count("\n") == 1
    assert tree_digest(ck) == before
    assert temps_beside(ck) == []


def test_demo_checkpoint_force_keeps_other_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--force replaces the checkpoint files only; the user's other files survive, and a
    failure half-way leaves the old folder exactly as it was."""
    from engram_trt.models.engram_llama import demo

    def small_demo(out: Path, seed: int = 0, **_: object) -> Path:  # the 2.4 GiB demo, in miniature
        return make_tiny_checkpoint(Path(out), seed=seed)

    monkeypatch.setattr(demo, "make_demo_checkpoint", small_demo)
    monkeypatch.setattr(demo, "demo_bytes_needed", lambda: 1)
    out = tmp_path / "ck"
    make_tiny_checkpoint(out, seed=5)
    (out / "README.md").write_text("mine\n")
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")  # a stale shard: a checkpoint file
    before = tree_digest(out)

    def broken(out: Path, seed: int = 0, **_: object) -> Path:
        make_tiny_checkpoint(Path(out), seed=seed)
        raise OSError(28, "No space left on device", str(out))

    monkeypatch.setattr(demo, "make_demo_checkpoint", broken)
    with pytest.raises(OSError):
        demo.write_demo_checkpoint(out, seed=1, force=True)
    assert tree_digest(out) == before and temps_beside(out) == []
    monkeypatch.setattr(demo, "make_demo_checkpoint", small_demo)
    demo.write_demo_checkpoint(out, seed=1, force=True)
    after = tree_digest(out)
    assert after["README.md"] == before["README.md"]
    assert "model-00009-of-00009.safetensors" not in after
    assert after["model-00001-of-00001.safetensors"] != before["model-00001-of-00001.safetensors"]
    assert temps_beside(out) == []


# ---------------------------------------------------------------- builds
def test_failed_builds_leave_the_previous_folder_whole(
    engine: Path, tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = tree_digest(engine)
    # Refused before any work: --repack-tables naming a file.
    a_file = tmp_path / "tables.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(EngramError, match="--repack-tables .* is not a folder"):
        build(tiny_ckpt, engine, repack_tables_dir=a_file, build_engine_if_possible=False, progress=False)
    assert tree_digest(engine) == before
    # A failure in the middle (export), and one at the very end (the swap).
    from engram_trt.models.engram_llama.architecture import EngramLlamaArchitecture

    def fail(*a: object, **k: object) -> None:
        raise EngramError("simulated export failure")

    monkeypatch.setattr(EngramLlamaArchitecture, "export_onnx", fail)
    with pytest.raises(EngramError, match="simulated export failure"):
        build(tiny_ckpt, engine, build_engine_if_possible=False, progress=False)
    assert tree_digest(engine) == before and temps_beside(engine) == []
    monkeypatch.undo()

    def no_swap(new: Path, target: Path) -> None:
        raise OSError(28, "No space left on device", str(target))

    monkeypatch.setattr(atomic, "replace_dir", no_swap)
    with pytest.raises(OSError):
        build(tiny_ckpt, engine, build_engine_if_possible=False, progress=False)
    assert tree_digest(engine) == before and temps_beside(engine) == []


def test_rebuild_keeps_user_files_and_refuses_foreign_folders(engine: Path, tiny_ckpt: Path, tmp_path: Path) -> None:
    # A rebuild of our own folder: our files replaced, the user's note carried over.
    (engine / "sub").mkdir()
    (engine / "sub" / "keep.bin").write_bytes(b"\x01\x02")
    build(tiny_ckpt, engine, build_engine_if_possible=False, progress=False)
    assert (engine / "NOTES.txt").read_text() == "the user's own notes\n"
    assert (engine / "sub" / "keep.bin").read_bytes() == b"\x01\x02"
    # A user's model.onnx.data beside our build (which writes no external data) is not ours.
    (engine / "model.onnx.data").write_bytes(b"user data")
    with pytest.raises(EngramError, match="model.onnx.data there was not written by the earlier build.*--force"):
        build(tiny_ckpt, engine, build_engine_if_possible=False, progress=False)
    assert (engine / "model.onnx.data").read_bytes() == b"user data"
    # A folder without our manifest is not ours: refused, untouched.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.onnx").write_bytes(b"someone else's graph")
    (foreign / "model.onnx.data").write_bytes(b"someone else's weights")
    with pytest.raises(EngramError, match="holds files engram-trt did not write.*--force"):
        build(tiny_ckpt, foreign, build_engine_if_possible=False, progress=False)
    assert (foreign / "model.onnx").read_bytes() == b"someone else's graph"
    assert (foreign / "model.onnx.data").read_bytes() == b"someone else's weights"
    # With --force the build's names are replaced; nothing else goes.
    (foreign / "README").write_text("keep me")
    r = build(tiny_ckpt, foreign, build_engine_if_possible=False, progress=False, force=True)
    assert (foreign / "README").read_text() == "keep me"
    assert not (foreign / "model.onnx.data").exists() and r.onnx_path.read_bytes() != b"someone else's graph"


def test_output_inside_the_checkpoint_is_refused(tmp_path: Path, tiny_ckpt: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    before = tree_digest(ck)
    for out, needle in (
        (ck, "inside the checkpoint folder"),
        (ck / "engine", "inside the checkpoint folder"),
        (tmp_path, "lies inside --output"),
    ):
        with pytest.raises(EngramError, match=needle):
            build(ck, out, build_engine_if_possible=False, progress=False)
    with pytest.raises(EngramError, match="--repack-tables .* is inside the checkpoint"):
        build(ck, tmp_path / "eng", repack_tables_dir=ck / "packed", build_engine_if_possible=False, progress=False)
    with pytest.raises(EngramError, match="--repack-tables .* is inside --output"):
        build(
            ck,
            tmp_path / "eng",
            repack_tables_dir=tmp_path / "eng" / "packed",
            build_engine_if_possible=False,
            progress=False,
        )
    assert tree_digest(ck) == before and not (tmp_path / "eng").exists()


def _start_paused_build(ck: Path, out: Path, point: str, flag: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = env_for_subprocess(**{atomic.PAUSE_ENV: point, atomic.PAUSE_FLAG_ENV: str(flag)})
    return subprocess.Popen(
        [sys.executable, "-m", "engram_trt", "build", str(ck), "-o", str(out), "--no-engine", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(flag: Path, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not flag.exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"the build ended before its pause point: {p.stderr.read()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"no pause at {flag.name} within {timeout} s")
        time.sleep(0.05)


def _can_exchange(folder: Path) -> bool:
    a, b = folder / ".probe-a", folder / ".probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return atomic.exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


KILL_POINTS = ("build:check", "build:tables", "build:export", "build:commit", "swap:exchanged")


def test_build_killed_at_each_point_leaves_a_whole_folder(tmp_path: Path, tiny_ckpt: Path) -> None:
    """kill -9 a rebuild at five points (before and during the work, just before the
    swap, just after the exchange): the engine folder is always whole (the old one, or
    after the exchange the new one, which is the same build), and the next build starts
    by removing what the dead one left."""
    first = tmp_path / "first"
    build(tiny_ckpt, first, build_engine_if_possible=False, progress=False)
    (first / "NOTES.txt").write_text("mine\n")
    good = tree_digest(first)
    exchanges = _can_exchange(tmp_path)
    # Without RENAME_EXCHANGE the last point is between the two renames of the fallback.
    points = KILL_POINTS if exchanges else KILL_POINTS[:-1] + ("swap:moved-old",)
    procs: dict[str, tuple[subprocess.Popen, Path, Path]] = {}
    for i, point in enumerate(points):
        out = tmp_path / f"eng{i}"
        shutil.copytree(first, out, copy_function=os.link)
        flag = tmp_path / f"paused{i}"
        procs[point] = (_start_paused_build(tiny_ckpt, out, point, flag), out, flag)
    for point, (proc, out, flag) in procs.items():
        _wait_for(flag, [proc])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    for point, (proc, out, flag) in procs.items():
        left = temps_beside(out)
        assert left, f"{point}: the killed build should have left its temporary (that is what the next start removes)"
        if point == "swap:moved-old":
            # The old folder was moved aside and the new one not yet renamed in: the
            # next start puts the old one back, whole.
            assert not out.exists()
            atomic.clean_dead_temps(out)
        now = tree_digest(out)
        if point == "swap:exchanged":
            # The new folder is in place: the same inputs give the same files (the
            # report's timings aside), the user's note carried over.
            assert {k: v for k, v in now.items() if k != "build_report.json"} == {
                k: v for k, v in good.items() if k != "build_report.json"
            }, point
        else:
            assert now == good, point
        r = build(tiny_ckpt, out, build_engine_if_possible=False, progress=False)
        assert temps_beside(out) == [], point
        assert (out / "NOTES.txt").read_text() == "mine\n" and r.manifest_path.read_bytes() == (
            first / "manifest.json"
        ).read_bytes()


def test_two_concurrent_builds_into_one_folder_both_succeed(tmp_path: Path, tiny_ckpt: Path) -> None:
    """The second build waits for the first's lock (and says so); both end with exit 0
    and the folder holds one whole build."""
    out = tmp_path / "eng"
    flag = tmp_path / "paused"
    first = _start_paused_build(tiny_ckpt, out, "build:export", flag)
    try:
        _wait_for(flag, [first])
        second = subprocess.Popen(
            [sys.executable, "-m", "engram_trt", "build", str(tiny_ckpt), "-o", str(out), "--no-engine"],
            env=env_for_subprocess(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        t0 = time.monotonic()
        waiting = ""
        while "waiting for another build" not in waiting and time.monotonic() - t0 < 120 and second.poll() is None:
            time.sleep(0.1)
            waiting = ""
            # The second build reports the wait on stderr; read what it has so far.
            if second.stderr is not None:
                import select

                if select.select([second.stderr], [], [], 0)[0]:
                    waiting = second.stderr.readline()
        assert "waiting for another build" in waiting and f"(pid {first.pid})" in waiting, waiting
        assert second.poll() is None  # still waiting on the lock
    finally:
        first.send_signal(signal.SIGKILL)  # the paused first build never resumes: kill it, as a crash would
        first.wait(timeout=30)
    assert second.wait(timeout=300) == 0, second.stderr.read()[-2000:]
    assert temps_beside(out) == []
    # And two unpaused builds at once: both succeed, one after the other.
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "engram_trt", "build", str(tiny_ckpt), "-o", str(out), "--no-engine"],
            env=env_for_subprocess(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    assert temps_beside(out) == []
    m = json.loads((out / "manifest.json").read_text())
    assert m["tables"][0]["sha256"] == file_sha256(
        m["tables"][0]["file"], m["tables"][0]["offset"], m["tables"][0]["nbytes"]
    )


def test_build_past_the_file_size_limit_is_one_line_and_leaves_no_trace(engine: Path, tiny_ckpt: Path) -> None:
    """A write that fails (here: past RLIMIT_FSIZE, EFBIG, the portable stand-in for a
    full disk) ends in one line and exit 2; the previous folder is whole and no temporary
    remains."""
    import resource

    before = tree_digest(engine)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # ignored: the write fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = subprocess.run(
        [sys.executable, "-m", "engram_trt", "build", str(tiny_ckpt), "-o", str(engine), "--no-engine"],
        capture_output=True,
        text=True,
        env=env_for_subprocess(),
        timeout=300,
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("engram-trt: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "File too large" in proc.stderr and "nothing half-written was kept" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree_digest(engine) == before and temps_beside(engine) == []


def test_swap_without_exchange_restores_after_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem cannot exchange two folders, the old one is moved aside
    first; a process that dies between the two renames leaves it marked, and the next
    start puts it back."""
    target = tmp_path / "eng"
    target.mkdir()
    (target / "manifest.json").write_text("{}")
    new = atomic.temp_sibling(target, "build")
    (new / "manifest.json").write_text('{"new": 1}')
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    atomic.replace_dir(new, target)
    assert json.loads((target / "manifest.json").read_text()) == {"new": 1} and temps_beside(target) == []
    # Simulate the crash: the old folder moved aside by a process that is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = target.parent / f".{target.name}.old-{dead.pid}-0123abcd"
    os.rename(target, old)
    Path(str(old) + atomic.OWNER_SUFFIX).write_text(json.dumps({"pid": dead.pid, "start_time": None}))
    assert not target.exists()
    atomic.clean_dead_temps(target)
    assert json.loads((target / "manifest.json").read_text()) == {"new": 1} and temps_beside(target) == []
    # A temporary whose marker names a live process, or with no marker, is left alone.
    live = target.parent / f".{target.name}.build-{os.getpid()}-0badf00d"
    live.mkdir()
    Path(str(live) + atomic.OWNER_SUFFIX).write_text(
        json.dumps({"pid": os.getpid(), "start_time": atomic.process_start_time(os.getpid())})
    )
    stranger = target.parent / f".{target.name}.build-{dead.pid}-feedf00d"
    stranger.mkdir()
    atomic.clean_dead_temps(target)
    assert live.is_dir() and stranger.is_dir()


# ---------------------------------------------------------------- the demo's cache
def test_killed_demo_leaves_no_temporary_after_the_next_run(tmp_path: Path, demo_dir: Path) -> None:
    """A demo killed while it makes its checkpoint leaves a marked temporary; the next
    run removes it (and an old-style `.demo-checkpoint.tmp-PID` of a dead process too)."""
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint

    cache = tmp_path / "cache"
    cache.mkdir()
    flag = tmp_path / "paused"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint; ensure_demo_checkpoint()",
        ],
        env=env_for_subprocess(
            ENGRAM_TRT_CACHE=str(cache), **{atomic.PAUSE_ENV: "demo:tmp-made", atomic.PAUSE_FLAG_ENV: str(flag)}
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    legacy = cache / f".demo-checkpoint.tmp-{dead.pid}"
    try:
        _wait_for(flag, [proc])
        legacy.mkdir()
        (legacy / "model-00001-of-00002.safetensors").write_bytes(b"half")
        assert len(temps_beside(cache / "demo-checkpoint")) == 3  # the dead one's folder and marker, the legacy one
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The next run (the cache now holds a good demo, hard links to the suite's) reuses
    # it and removes what the dead runs left.
    shutil.copytree(demo_dir, cache / "demo-checkpoint", copy_function=os.link)
    assert ensure_demo_checkpoint(cache / "demo-checkpoint") == cache / "demo-checkpoint"
    assert temps_beside(cache / "demo-checkpoint") == []


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || mount -t tmpfs -o size=64k tmpfs /tmp",
        ],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not _namespaces_work(),
    reason="user and mount namespaces (unshare -rm, to mount a small tmpfs) are not available here",
)
def test_full_disk_mid_build_is_one_line_and_leaves_the_old_folder(
    engine: Path, tiny_ckpt: Path, tmp_path: Path
) -> None:
    """A real full disk: the engine folder on a 192 KiB tmpfs (in a private mount
    namespace) that holds the old build but not a second one. The build fails with
    ENOSPC in one line; the old folder is whole and no temporary is left."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (engine / "NOTES.txt").unlink()
    script = f"""
set -u
mount -t tmpfs -o size=192k tmpfs {mnt}
cp -r {engine} {mnt}/eng
(cd {mnt}/eng && sha256sum * > {out}/before.txt)
{sys.executable} -m engram_trt build {tiny_ckpt} -o {mnt}/eng --no-engine > /dev/null 2> {out}/stderr.txt
echo $? > {out}/rc.txt
(cd {mnt}/eng && sha256sum * > {out}/after.txt)
ls -A {mnt} > {out}/listing.txt
"""
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env_for_subprocess(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    err = (out / "stderr.txt").read_text()
    assert (out / "rc.txt").read_text().strip() == "2", err
    assert err.startswith("engram-trt: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "No space left on device" in err and "the disk is full" in err, err
    assert (out / "before.txt").read_text() == (out / "after.txt").read_text()
    assert (out / "listing.txt").read_text().split() == ["eng"]  # no temporary, no lock file left


# ---------------------------------------------------------------- locks and links
def test_locks_are_never_left_and_never_a_users_file(
    engine: Path, tiny_ckpt: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock of a write is .NAME.engram-trt.lock, removed by its holder: none is left
    after a finished or a failed build, a user's file of the old name (.NAME.lock) is
    never touched, a user's file of the lock's own name is refused (unchanged), and a
    lock a killed build left is taken over and removed."""
    user_old = tmp_path / ".eng.lock"
    user_old.write_text("the user's\n")
    assert main(["build", str(tiny_ckpt), "-o", str(engine), "--no-engine"]) == 0
    capsys.readouterr()
    assert user_old.read_text() == "the user's\n"
    assert not atomic.lock_path(engine).exists() and temps_beside(engine) == [".eng.lock"]  # only the user's

    import engram_trt.builder.build as b

    def boom(*a, **k):
        raise RuntimeError("an export that failed")

    with monkeypatch.context() as mp:
        mp.setattr(b, "_build_into", boom)
        assert main(["build", str(tiny_ckpt), "-o", str(engine), "--no-engine"]) == 2
    assert "an export that failed" in capsys.readouterr().err
    assert not atomic.lock_path(engine).exists() and temps_beside(engine) == [".eng.lock"]  # only the user's

    theirs = atomic.lock_path(engine)
    theirs.write_text("the user's notes, by chance under that name\n")
    before = tree_digest(engine)
    assert main(["build", str(tiny_ckpt), "-o", str(engine), "--no-engine"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(theirs) in err and "is not an engram-trt lock" in err and "move it away" in err
    assert theirs.read_text() == "the user's notes, by chance under that name\n" and tree_digest(engine) == before
    theirs.unlink()

    theirs.write_bytes(atomic.LOCK_MARK + b" pid 999999999\n")  # what a kill -9 leaves
    assert main(["build", str(tiny_ckpt), "-o", str(engine), "--no-engine"]) == 0
    assert not theirs.exists()
    capsys.readouterr()


def test_lock_holders_never_overlap_while_lock_files_come_and_go(tmp_path: Path) -> None:
    """Eight threads (each its own open file, as processes are) take the lock of one
    target 25 times each: never two inside at once, though every holder removes the
    file on the way out (a waiter that wakes on a removed file starts over)."""
    import threading

    target = tmp_path / "out"
    inside, overlaps, rounds = [0], [0], [0]
    guard = threading.Lock()

    def worker() -> None:
        for _ in range(25):
            with atomic.locked(target, "a test"):
                with guard:
                    inside[0] += 1
                    overlaps[0] += inside[0] > 1
                time.sleep(0.0005)
                with guard:
                    inside[0] -= 1
                    rounds[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert rounds[0] == 200 and overlaps[0] == 0
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_is_a_symbolic_link_is_written_through(
    engine: Path, tiny_ckpt: Path, tmp_path: Path, capsys
) -> None:
    """build -o LINK and triton-repo --out LINK rebuild the folder the link names; the link
    stays a link to it. A link to nothing is refused before any work."""
    link = tmp_path / "link"
    link.symlink_to(engine, target_is_directory=True)
    old_manifest = (engine / "manifest.json").read_bytes()
    assert main(["build", str(tiny_ckpt), "-o", str(link), "--no-engine", "--max-batch", "2"]) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(engine)
    assert (engine / "manifest.json").read_bytes() != old_manifest and (engine / "NOTES.txt").is_file()
    assert json.loads((engine / "manifest.json").read_text())["shapes"]["max_batch"] == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    repo = tmp_path / "repo"
    repo.mkdir()
    rlink = tmp_path / "repo-link"
    rlink.symlink_to(repo, target_is_directory=True)
    assert main(["triton-repo", str(engine), "--out", str(rlink)]) == 0
    out = capsys.readouterr().out
    assert rlink.is_symlink() and os.readlink(rlink) == str(repo) and (repo / "engram_llm" / "config.pbtxt").is_file()
    assert str(repo) in out

    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert main(["build", str(tiny_ckpt), "-o", str(dangling), "--no-engine"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a symbolic link to" in err and "which does not exist" in err
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(
    not _namespaces_work(),
    reason="user and mount namespaces (unshare -rm, to mount a small tmpfs) are not available here",
)
def test_a_mount_point_output_is_refused_before_any_work(tiny_ckpt: Path, tmp_path: Path) -> None:
    """build -o MOUNTPOINT: the new folder could never be swapped in (EBUSY after the whole
    build); refused first, naming the path and a folder inside it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    script = f"""
set -u
mount -t tmpfs -o size=1m tmpfs {mnt}
{sys.executable} -m engram_trt build {tiny_ckpt} -o {mnt} --no-engine > /dev/null 2> {out}/stderr.txt
echo $? > {out}/rc.txt
ls -A {mnt} > {out}/listing.txt
"""
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env_for_subprocess(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    err = (out / "stderr.txt").read_text()
    assert (out / "rc.txt").read_text().strip() == "2", err
    assert err.count("\n") == 1 and f"--output '{mnt}' is a mount point" in err and f"{mnt}/model" in err, err
    assert (out / "listing.txt").read_text() == ""
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_import_gguf_into_a_link_writes_where_it_points(tmp_path: Path, capsys) -> None:
    """import-gguf FILE LINK (a link to an empty folder: once 'Not a directory' after the
    whole import) and FILE LINK --force (once: the link replaced by a folder): the link
    stays a link, the folder it names gets the checkpoint, the user's file there is kept."""
    pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
    from helpers.gguf_files import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf")
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "ilink"
    link.symlink_to(real, target_is_directory=True)
    assert main(["import-gguf", str(tmp_path / "m.gguf"), str(link), "--no-progress"]) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(real) and (real / "config.json").is_file()
    (real / "notes.txt").write_text("mine\n")
    first = (real / "model.safetensors").read_bytes()
    assert main(["import-gguf", str(tmp_path / "m.gguf"), str(link), "--force", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "notes.txt").read_text() == "mine\n" and (real / "model.safetensors").read_bytes() == first
    assert str(real) in out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
