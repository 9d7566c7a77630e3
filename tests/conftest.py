"""Shared fixtures: tiny checkpoints made in the test session, compiled once each.

The session runs on pytest-xdist workers, a worker a core (two on the CI machine; pyproject's
addopts): most tests wait on a process they started (a server, a rank, a compile importing
torch) and leave a core idle.
The workers share one kiln cache and one set of transformers oracles; tests that share an
expensive session fixture (the real model's compiles) carry one `xdist_group`, so one
worker builds it (`--dist loadgroup`); every other test module is a group of its own, so
its module-scoped server starts once."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Two workers on two cores, each running kernels on two OpenMP threads: an idle thread waits
# asleep rather than spinning on the core the other worker's process needs (set before
# anything loads an OpenMP runtime; processes the tests start inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import hf_oracle
import pytest

from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.example import make_checkpoint

# The session's own kiln cache (artefacts, kernel builds, file hashes), shared with the
# processes tests start and with the other xdist workers (they inherit the variable below
# from the controller, which imports this file first); the user's ~/.cache/kiln is never
# touched.
_SHARED = "KILN_TEST_SESSION_CACHE"
if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_SHARED)):
    os.environ[_SHARED] = tempfile.mkdtemp(prefix="kiln-test-cache-")
os.environ["KILN_CACHE_DIR"] = os.environ[_SHARED]
SESSION_KERNELS = Path(os.environ["KILN_CACHE_DIR"]) / "kernels"


# transformers' answers for the real models, computed beside the session (tests/hf_oracle.py)
# by one process a model, whichever worker claims it first (ORACLE_DIR/<name>.claim holds
# that process's pid)
ORACLE_DIR = Path(os.environ["KILN_CACHE_DIR"]) / "hf-oracle"
ORACLE_WAIT_S = 1200
_oracles: list[subprocess.Popen[bytes]] = []  # those this process started (reaped at the end)


def _start_oracle(names: list[str]) -> None:
    """Start one oracle process for those of `names` no worker has claimed yet."""
    ORACLE_DIR.mkdir(parents=True, exist_ok=True)
    mine = []
    for name in names:
        try:
            fd = os.open(ORACLE_DIR / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        mine.append(name)
    if not mine:
        return
    log = ORACLE_DIR / f"{'-'.join(mine)}.log"
    with open(log, "wb") as out:
        script = Path(__file__).with_name("hf_oracle.py")
        proc = subprocess.Popen(
            [sys.executable, str(script), str(ORACLE_DIR), *mine], stdout=out, stderr=out
        )
    for name in mine:
        (ORACLE_DIR / f"{name}.claim").write_text(f"{proc.pid} {log.name}")
    _oracles.append(proc)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start transformers on the real models the collected tests will hold kiln to, so their
    30-60 s of reading GGUF files run while other tests do."""
    if session.config.option.collectonly:
        return
    wanted = {f"{name}_oracle": name for name in hf_oracle.CASES}
    names = {
        wanted[f]
        for item in session.items
        for f in getattr(item, "fixturenames", ())
        if f in wanted
    }
    if names:
        _start_oracle(sorted(names, key=list(hf_oracle.CASES).index))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test module is one xdist group unless it names its own (before xdist reads the
    marks): a module's tests share its module-scoped fixtures, a server mostly."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(
                pytest.mark.xdist_group(item.path.relative_to(config.rootpath).as_posix())
            )


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker a core, at most four (each holds its own session fixtures)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _dead(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped by its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _oracle(name: str) -> dict[str, Any]:
    _start_oracle([name])
    done, claim = ORACLE_DIR / f"{name}.json", ORACLE_DIR / f"{name}.claim"
    deadline = time.monotonic() + ORACLE_WAIT_S
    while not done.exists():
        held = claim.read_text().split()
        if held:  # the claiming worker has written its process's pid and log
            pid, log = int(held[0]), ORACLE_DIR / held[1]
            if _dead(pid) and not done.exists():
                pytest.fail(f"transformers' oracle for {name} failed:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"transformers' oracle for {name}: no answer in {ORACLE_WAIT_S} s")
        time.sleep(0.2)
    return hf_oracle.load(name, ORACLE_DIR)


@pytest.fixture(scope="session")
def smollm2_oracle() -> dict[str, Any]:
    """transformers on SmolLM2's Q4_1 file: its chat answer to tests/hf_oracle.py's question."""
    return _oracle("smollm2")


@pytest.fixture(scope="session")
def gemma3_oracle() -> dict[str, Any]:
    """transformers on Gemma 3's Q4_K_M file: its greedy continuations of three prompts."""
    return _oracle("gemma3")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's cache goes with it (its artefacts are tens of MB a session), and an
    oracle still running (a session stopped early) with it: both when the whole session
    ends (the controller, or a run without workers), not when one worker does."""
    if hasattr(session.config, "workerinput"):
        return
    for claim in ORACLE_DIR.glob("*.claim"):
        held = claim.read_text().split()
        if held and not _dead(int(held[0])):
            with contextlib.suppress(OSError):
                os.kill(int(held[0]), signal.SIGKILL)
    for proc in _oracles:
        proc.poll()
    shutil.rmtree(os.environ["KILN_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(family, **config) -> folder with config.json, weights and tokenizer."""
    made: dict[str, Path] = {}

    def make(family: str = "llama", **kw: Any) -> Path:
        key = json.dumps([family, kw], sort_keys=True)
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{family}"), family, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def artefact(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Callable[..., Path]
) -> Callable[..., Path]:
    """artefact(family, compile_args={...}, **config) -> compiled artefact folder: float32
    and a CPU target unless compile_args say otherwise (an unset --device is the GPU on a
    machine that has one, as in SGLang; the tests' references are CPU artefacts there too)."""
    made: dict[str, Path] = {}

    def make(family: str = "llama", compile_args: dict[str, Any] | None = None, **kw: Any) -> Path:
        cargs = {"dtype": "float32", "device": "cpu", **(compile_args or {})}
        key = json.dumps([family, cargs, kw], sort_keys=True)
        if key not in made:
            ckpt = checkpoint(family, **kw)
            out = tmp_path_factory.mktemp(f"art-{family}") / "art"
            compile_model(ServerArgs(model_path=str(ckpt), **cargs), out)
            made[key] = out
        return made[key]

    return make


@pytest.fixture
def damaged_llama(artefact: Callable[..., Path], tmp_path: Path) -> Path:
    """A copy of the llama artefact with one byte of its weight file flipped (its manifest
    untouched): its checksum no longer matches."""
    art = tmp_path / "art"
    shutil.copytree(artefact("llama"), art)
    weights = art / "weights/rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    return art


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kiln cache for this test (and the processes it starts), but for the kernel
    store, which is the session's: kernel builds are keyed by source, flags and compiler, and
    one build costs 5-10 s on a CI machine (tests of the store use their own folders)."""
    root = tmp_path / "kiln-cache"
    SESSION_KERNELS.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    (root / "kernels").symlink_to(SESSION_KERNELS, target_is_directory=True)
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    return root
