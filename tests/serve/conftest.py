"""A real `kiln serve` process on loopback, started once per module."""

from __future__ import annotations

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
