"""Shared fixtures: tiny checkpoints made in the test session, compiled once each."""

from __future__ import annotations

import json
import os
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
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kiln cache for this test (and the processes it starts)."""
    root = tmp_path / "kiln-cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    return root
