"""Shared fixtures: tiny checkpoints made in the test session, compiled once each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_oracle
import pytest

from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.example import make_checkpoint

# The session's own kiln cache (artefacts, kernel builds, file hashes), shared with the
# processes tests start; the user's ~/.cache/kiln is never touched.
os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-cache-")
SESSION_KERNELS = Path(os.environ["KILN_CACHE_DIR"]) / "kernels"


# transformers' answers for the real models, computed beside the session (tests/hf_oracle.py)
ORACLE_DIR = Path(os.environ["KILN_CACHE_DIR"]) / "hf-oracle"
_oracles: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}  # name -> process, its log


def _start_oracle(names: list[str]) -> None:
    ORACLE_DIR.mkdir(parents=True, exist_ok=True)
    log = ORACLE_DIR / f"{'-'.join(names)}.log"
    with open(log, "wb") as out:
        script = Path(__file__).with_name("hf_oracle.py")
        proc = subprocess.Popen(
            [sys.executable, str(script), str(ORACLE_DIR), *names], stdout=out, stderr=out
        )
    _oracles.update(dict.fromkeys(names, (proc, log)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start transformers on the real models the collected tests will hold kiln to, so their
    30-60 s of reading GGUF files run on the core the tests leave idle."""
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


def _oracle(name: str) -> dict[str, Any]:
    if name not in _oracles:
        _start_oracle([name])
    (proc, log), done = _oracles[name], ORACLE_DIR / f"{name}.json"
    while not done.exists():
        if proc.poll() is not None and not done.exists():
            pytest.fail(f"transformers' oracle for {name} failed:\n{log.read_text()[-3000:]}")
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
    oracle still running (a session stopped early) with it."""
    for proc, _ in set(_oracles.values()):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
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
    """artefact(family, compile_args={...}, **config) -> compiled artefact folder."""
    made: dict[str, Path] = {}

    def make(family: str = "llama", compile_args: dict[str, Any] | None = None, **kw: Any) -> Path:
        cargs = {"dtype": "float32", **(compile_args or {})}
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
