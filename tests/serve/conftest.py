"""A real `kiln serve` process on loopback, started once per module."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serve_helpers import Server, start_server, stop_server


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(art: Path, *flags: str) -> Server:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = start_server(art, log, *flags)
        servers.append(server)
        return server

    yield make
    for s in servers:
        if s.process.poll() is None:
            stop_server(s)


@pytest.fixture(scope="session")
def smollm2_gptq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model as a GPTQ checkpoint (4-bit, group 64, round-to-nearest codes), written
    from its GGUF file's float weights."""
    from int4_files import hf_folder_from_gguf, write_int4_checkpoint

    from kiln.example import fetch

    root = tmp_path_factory.mktemp("smollm2-gptq")
    hf = hf_folder_from_gguf(fetch("smollm2"), root / "float")
    write_int4_checkpoint(hf, root / "SmolLM2-135M-Instruct-GPTQ", "gptq", 64)
    shutil.rmtree(hf)  # its float32 weights (540 MB) are not read again
    return root / "SmolLM2-135M-Instruct-GPTQ"


@pytest.fixture(scope="session")
def real_artefact(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """real_artefact(checkpoint, **compile flags): the real model compiled once a session per
    flags (each compile of it is ~7 s on a slow CI core; the quality gate and the served
    tests share them)."""
    import json

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    made: dict[str, Path] = {}

    def make(ckpt: Path, **flags: str) -> Path:
        key = json.dumps([str(ckpt), flags], sort_keys=True)
        if key not in made:
            out = tmp_path_factory.mktemp("real") / "art"
            compile_model(ServerArgs(model_path=str(ckpt), **flags), out)
            made[key] = out
        return made[key]

    return make
