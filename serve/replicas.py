"""--dp-size N: N data-parallel replicas of one artefact behind one endpoint.

kiln does not route requests itself: SGLang's router (the `sglang-router` package, the Rust
load balancer SGLang deployments already run) listens on --host / --port and spreads
requests (--load-balance-method: in turn, or to the replica with the fewest in flight) over
N `kiln serve` processes on free loopback ports, each with its share of the threads and the
user's other runtime flags. A request's Authorization header goes through the router to the
replica, which checks --api-key as a lone server does.

This process only supervises: once every replica answers /health it starts the router; when
a replica or the router exits on its own, it stops the others and exits 1; SIGTERM / SIGINT
stop the router first (no new requests), then the replicas (each drains as a lone server
does under --shutdown-timeout), and it exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kiln.args import FLAGS, ArgError, ServerArgs
from kiln.core import artefact as fmt
from kiln.runtime import numa

log = logging.getLogger("kiln.serve")

_WATCH_S = 0.2
_START_TIMEOUT_S = 300
# What the replicas do not take from the user: this process decides them.
_OWN = ("host", "port", "dp_size", "threads", "config", "numa_node")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _replica_config(explicit: dict[str, Any], folder: Path) -> Path:
    """The user's flags for the replicas, as a --config file (flag names as keys)."""
    import yaml

    values = {FLAGS[k].name.lstrip("-"): v for k, v in explicit.items() if k not in _OWN}
    path = folder / "replica.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def serve_replicas(artefact: Path, args: ServerArgs, explicit: dict[str, Any]) -> int:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise ArgError(
            f"--dp-size {args.dp_size}: needs SGLang's router: pip install sglang-router"
        ) from None
    n = args.dp_size
    threads = [max(1, (args.threads or os.cpu_count() or 1) // n)] * n
    nodes = _replica_nodes(artefact, args)
    if nodes and not args.threads:  # each replica its ranks' shares of their nodes' cores
        shares = numa.shares([x for own in nodes for x in own])
        threads = [sum(shares[i * len(own) : (i + 1) * len(own)]) for i, own in enumerate(nodes)]
    folder = Path(tempfile.mkdtemp(prefix="kiln-dp-"))
    config = _replica_config(explicit, folder)
    urls = []
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for i in range(n):
            port = _free_port()
            urls.append(f"http://127.0.0.1:{port}")
            argv = [sys.executable, "-m", "kiln", "serve", str(artefact), "--config", str(config)]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--threads", str(threads[i])]
            if nodes:
                argv += ["--numa-node", *map(str, nodes[i])]
            procs.append((f"replica {i} ({urls[-1]})", subprocess.Popen(argv)))
        failed = _wait_healthy(urls, procs, stop)
        if failed is None and not stop.is_set():
            router = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
            router += ["--host", args.host, "--port", str(args.port), *_policy(args)]
            # its metrics exporter on a free port too (it defaults to a fixed one)
            router += ["--prometheus-port", str(_free_port()), "--log-level", "warn"]
            name = f"SGLang's router (http://{args.host}:{args.port})"
            procs.append((name, subprocess.Popen(router)))
            log.warning(
                "%d data-parallel replicas (%s, %s threads) behind SGLang's router on http://%s:%d",
                n,
                ", ".join(urls),
                "/".join(map(str, threads)),
                args.host,
                args.port,
            )
            failed = _watch(procs, stop)
    finally:
        _stop_all(procs)
    if failed:
        log.error("%s; the other replicas and the router are stopped", failed)
        return 1
    return 0


def _policy(args: ServerArgs) -> list[str]:
    """The router's flags for --load-balance-method. shortest_queue: its cache_aware policy
    routes to the replica with the fewest requests in flight whenever the load is
    imbalanced, (max - min) > abs and max > rel * min; at abs 0 and rel 1 any difference
    is, and where every replica carries the same load its prefix tree only breaks the tie."""
    if args.load_balance_method == "shortest_queue":
        thresholds = ["--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0"]
        return ["--policy", "cache_aware", *thresholds]
    return ["--policy", "round_robin"]


def _replica_nodes(artefact: Path, args: ServerArgs) -> list[list[int]] | None:
    """--numa-node for each replica: replica r's T ranks take the list's elements
    r*T .. r*T+T-1, as SGLang's data-parallel schedulers index it (runtime/numa.py)."""
    if not args.numa_node:
        return None
    tp = int(fmt.read_manifest(artefact)["runtime"]["tp_size"])
    n = args.dp_size
    nodes = numa.check(args.numa_node, n * tp, f"{n} replicas of {tp} rank(s)")
    return [nodes[r * tp : (r + 1) * tp] for r in range(n)]


def _wait_healthy(
    urls: list[str], procs: list[tuple[str, subprocess.Popen[bytes]]], stop: threading.Event
) -> str | None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    waiting = set(urls)
    while waiting and not stop.is_set():
        gone = _exited(procs)
        if gone:
            return gone
        if time.monotonic() > deadline:
            return f"replicas {sorted(waiting)} did not become healthy in {_START_TIMEOUT_S}s"
        waiting = {u for u in waiting if not _healthy(u)}
        stop.wait(_WATCH_S)
    return None


def _exited(procs: list[tuple[str, subprocess.Popen[bytes]]]) -> str | None:
    for name, p in procs:
        code = p.poll()
        if code is not None:
            return f"{name} exited with code {code}"
    return None


def _watch(procs: list[tuple[str, subprocess.Popen[bytes]]], stop: threading.Event) -> str | None:
    while not stop.wait(_WATCH_S):
        gone = _exited(procs)
        if gone:
            return gone
    return None


def _stop_all(procs: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """SIGTERM to the router (started last) first, then to every replica at once (they
    drain side by side); SIGKILL to whatever is left after 60 s."""
    if not procs:
        return
    *replicas, last = procs
    for group in ([last], replicas):
        live = [p for _, p in group if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
