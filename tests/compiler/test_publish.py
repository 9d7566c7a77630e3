"""Publishing artefacts beside other processes: no failures, no mixed folders, no
leftovers, readable modes, and a failed write (a full disk) is one line."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.compiler.publish import publish, staging_dir
from kiln.core.target import cpu_target
from kiln.kernels import native

WRITER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from kiln.compiler.publish import publish, staging_dir
    out, who, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(rounds):
        tmp = staging_dir(out)
        tag = f"{who}-{i}"
        (tmp / "payload").write_text(tag * 1000)
        (tmp / "manifest.json").write_text(json.dumps({"tag": tag}))
        publish(tmp, out)
    """
)


def _read(out: Path) -> tuple[str, str] | None:
    """Both files of one published folder: opened once, read relative to it."""
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:

        def text(name: str) -> str:
            with open(os.open(name, os.O_RDONLY, dir_fd=fd)) as f:
                return f.read()

        return json.loads(text("manifest.json"))["tag"], text("payload")
    except FileNotFoundError:  # the folder was replaced and removed while we read it
        return None
    finally:
        os.close(fd)


def test_concurrent_publishers_never_fail_mix_or_leave_copies(tmp_path) -> None:
    out = tmp_path / "art"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(out), who, "300"]) for who in ("a", "b")
    ]
    seen = 0
    while any(w.poll() is None for w in writers):
        got = _read(out)
        if got is not None:
            tag, payload = got
            assert payload == tag * 1000, "a reader saw one publish's manifest with another's files"
            seen += 1
    assert [w.returncode for w in writers] == [0, 0]
    assert seen > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert _read(out) is not None


def test_leftovers_of_a_killed_compile_are_swept(tmp_path) -> None:
    out = tmp_path / "art"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".art.tmp-{dead.pid}-xyz"
    stale.mkdir()
    (stale / "weights").write_bytes(b"partial")
    mine = tmp_path / f".art.tmp-{os.getpid()}-live"  # a compile still running: kept
    mine.mkdir()
    tmp = staging_dir(out)
    (tmp / "manifest.json").write_text("{}")
    publish(tmp, out)
    assert not stale.exists() and mine.exists() and (out / "manifest.json").is_file()


def _compile_with_file_limit(ckpt: Path, out: Path, limit: int) -> subprocess.CompletedProcess:
    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    argv = ["compile", "--model-path", str(ckpt), "--dtype", "float32", "-o", str(out)]
    return subprocess.run(
        [sys.executable, "-m", "kiln", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_files,
    )


def test_a_failed_write_is_one_line_and_leaves_nothing(checkpoint, tmp_path, fresh_cache) -> None:
    """The kernel refuses writes past RLIMIT_FSIZE the way a full disk refuses them: the
    same error path (OSError from the artefact writer), reproducible in any sandbox."""
    toolchain = native.Toolchain.find()
    assert toolchain is not None
    native.build(cpu_target("native"), toolchain)  # in the kernel store before the limit
    out = tmp_path / "art"
    r = _compile_with_file_limit(checkpoint("llama"), out, 64 * 1024)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the artefact" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["kiln-cache"]
    assert not [p for p in (fresh_cache / "artefacts").iterdir() if not p.name.endswith(".lock")]


def test_artefacts_get_the_umasks_normal_modes(checkpoint, tmp_path, fresh_cache) -> None:
    old = os.umask(0o022)
    try:
        art = compile_model(
            ServerArgs(model_path=str(checkpoint("llama")), dtype="float32"), tmp_path / "art"
        ).path
    finally:
        os.umask(old)
    modes = {p.relative_to(art): stat.S_IMODE(p.stat().st_mode) for p in art.rglob("*")}
    assert stat.S_IMODE(art.stat().st_mode) == 0o755
    assert modes[Path("weights")] == 0o755
    assert modes[Path("weights/rank0.safetensors")] == 0o644
    assert modes[Path("manifest.json")] == 0o644
    assert all(m in (0o755, 0o644) for m in modes.values()), modes


def test_publish_is_quick_when_uncontended(tmp_path) -> None:
    out = tmp_path / "art"
    t0 = time.perf_counter()
    for _ in range(20):
        tmp = staging_dir(out)
        (tmp / "manifest.json").write_text("{}")
        publish(tmp, out)
    assert time.perf_counter() - t0 < 5
