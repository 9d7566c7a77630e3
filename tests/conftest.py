"""Shared fixtures: tiny checkpoints made in the test session, compiled once each."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.example import make_checkpoint

# The session's own kiln cache (artefacts, kernel builds, file hashes), shared with the
# processes tests start; the user's ~/.cache/kiln is never touched.
os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-cache-")
SESSION_KERNELS = Path(os.environ["KILN_CACHE_DIR"]) / "kernels"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's cache goes with it (its artefacts are tens of MB a session)."""
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
