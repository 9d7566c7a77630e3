"""`kiln serve`: load an artefact and serve it with uvicorn until SIGINT/SIGTERM.

The port is bound before the artefact is loaded, so "port in use" is the first thing a
user hears, in one line. On SIGTERM or SIGINT the server stops taking requests (/health
turns 503), lets those in flight finish for up to `--shutdown-timeout` seconds, stops the
rest (each stream gets a final error event, each waiting client a 503), and exits 0. A
second signal skips the wait. If a tensor-parallel rank dies, the engine cannot go on: /health
turns 503, every request in flight ends with a 503 naming the rank, and the server exits 1
(within seconds, not after --dist-timeout: runtime/parallel.py watches processes and the
other nodes' heartbeats and stops the other ranks), so a supervisor restarts it. The 503s
are sent from the event loop, since the engine thread may be waiting on the lost rank.
A step that runs past --watchdog-timeout ends the server the same way (runtime/watchdog.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from kiln.args import ServerArgs
from kiln.core.artefact import FileCheck
from kiln.runtime.gc_watch import warn_long_collections
from kiln.runtime.watchdog import Watchdog
from kiln.serve.context import ServingContext, read_templates

log = logging.getLogger("kiln.serve")

SHUTDOWN = {"type": "abort", "message": "the server is shutting down", "status_code": 503}
# How long stopped streams get to send their final events before connections close.
_FLUSH_SECONDS = 5


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts once the server is ready).

    Made as an IPPROTO_TCP socket, not protocol 0: asyncio sets TCP_NODELAY only on
    connections whose socket says TCP, and without it every small response on a kept-alive
    connection waited ~40 ms for the client's delayed ACK (Nagle). Set here too, for
    servers that read the option from the listener."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class KilnServer(uvicorn.Server):
    """uvicorn's server with kiln's shutdown: drain, then stop, then exit 0 (uvicorn would
    re-raise the signal and exit 143)."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, drain_seconds: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_now = asyncio.Event()
        self._drain: asyncio.Future[None] | None = None
        self.failure: str | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._on_signal)

    def fatal(self, reason: str) -> None:
        """The engine cannot go on (a rank died): any thread may call this."""
        self.failure = reason
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._on_fatal)

    def _on_fatal(self) -> None:
        assert self.failure is not None
        engine = self.ctx.async_engine
        if engine.crash_dump is not None:  # before the requests in flight are failed
            engine.crash_dump.dump(self.failure, engine.in_flight())
        reason = {"type": "abort", "message": self.failure, "status_code": 503}
        engine.abort_all(reason)  # frees the engine's state, if its thread can still run
        engine.fail_all(reason)  # answers every client now, whether or not it can
        self._stop_now.set()
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    def _on_signal(self) -> None:
        if self._drain is not None:
            log.info("second signal: stopping the requests in flight now")
            self._stop_now.set()
            return
        self.ctx.async_engine.draining = True
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        engine = self.ctx.async_engine
        log.info(
            "shutting down: %d requests in flight; up to %.0fs for them to finish",
            engine.num_in_flight,
            self.drain_seconds,
        )
        deadline = time.monotonic() + self.drain_seconds
        while engine.num_in_flight and time.monotonic() < deadline and not self._stop_now.is_set():
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.info("stopping %d requests still in flight", engine.num_in_flight)
            engine.abort_all(SHUTDOWN)
            deadline = time.monotonic() + _FLUSH_SECONDS
            while engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True


def _follow(artefact: Path, args: ServerArgs, explicit: dict[str, Any]) -> int:
    """A node other than node 0 of a multi-node group: no HTTP, only its ranks
    (runtime/parallel.py), once its own copy of the artefact checks out."""
    from kiln.args.stages import refuse_compile_time_changes
    from kiln.runtime.artefact import checked_manifest
    from kiln.runtime.parallel import follow

    manifest = checked_manifest(artefact)
    refuse_compile_time_changes(explicit, manifest)
    return follow(
        artefact,
        int(manifest["runtime"]["tp_size"]),
        args.nnodes,
        args.node_rank,
        args.dist_init_addr,
        args.dist_timeout,
        args.threads,
        args.trust_remote_code,
        args.numa_node,
        not args.weight_loader_disable_mmap,
    )


def serve(
    artefact: str | Path,
    explicit: dict[str, Any],
    check: FileCheck | None = None,
    clean_start: bool = False,
) -> None:
    """Serve `artefact`; `explicit` are the server arguments the user gave; `check`, the
    artefact's checksums already under way (kiln/cli.py); `clean_start`, nothing but
    imports ran in this process before (no compile): see create_app."""
    from kiln.runtime.engine import Engine
    from kiln.serve.app import create_app

    args = ServerArgs(**explicit)
    templates = read_templates(args)  # checked before the artefact loads (seconds)
    if args.node_rank > 0 or args.dp_size > 1:
        gc.enable()  # not a single server's start (kiln/cli.py turned it off for that)
    if args.node_rank > 0:
        sys.exit(_follow(Path(artefact), args, explicit))
    if args.dp_size > 1:
        from kiln.serve.replicas import serve_replicas

        bind(args.host, args.port).close()  # the router's port: a one-line error if taken
        sys.exit(serve_replicas(Path(artefact), args, explicit))
    sock = bind(args.host, args.port)
    try:
        engine = Engine(artefact, file_check=check, **explicit)
        app = create_app(engine, args, clean_start, templates)
        level = (args.log_level_http or args.log_level).lower()
        config = uvicorn.Config(
            app,
            log_level=level,
            timeout_graceful_shutdown=_FLUSH_SECONDS,
            root_path=args.fastapi_root_path or "",
        )
        server = KilnServer(config, app.state.kiln, args.shutdown_timeout)
        engine.on_rank_failure(server.fatal)
        engine.on_fatal(server.fatal)
        watchdog = Watchdog(
            app.state.kiln.async_engine.thread,
            args.watchdog_timeout,
            args.soft_watchdog_timeout,
            server.fatal,
        )
        watchdog.start()
        if args.gc_warning_threshold_secs > 0:
            warn_long_collections(args.gc_warning_threshold_secs)
        server.run(sockets=[sock])
        watchdog.stop()
    finally:
        sock.close()
    if server.failure is not None:
        sys.exit(f"kiln serve: {server.failure}")
