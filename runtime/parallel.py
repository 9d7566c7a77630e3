"""Tensor-parallel execution: one process per rank over torch.distributed.

Rank 0 is the engine's own process: it schedules, and before each step it broadcasts the
step's inputs (runtime/step.py `StepInputs`, one int64 tensor) to the other ranks.
Every rank then runs the same step on its own graph, weights and KV heads; the graph's
all_reduce / all_gather ops (passes/shard.py) are the only other traffic. Ranks 1..T-1 are
`python -m kiln.runtime.rank_worker` processes started here, which exit when rank 0 says stop
or when their connection to it breaks (rank 0 gone). Rank 0 watches them: one that exits
while the group runs (a crash, a SIGKILL) is named in `TPGroup.failure` at once, the other
ranks are stopped (a group short of a rank cannot run a step) and `on_failure` is told
(`kiln serve` then turns /health 503, ends every request with the reason and exits 1),
rather than the loss being found when a collective times out.

Several machines (`--nnodes N --node-rank k --dist-init-addr host:port`, SGLang's flags):
node k runs ranks [k T/N, (k+1) T/N). Node 0's `kiln serve` is rank 0 and serves HTTP; on
every other node `kiln serve` only starts and watches its ranks (`follow`), exiting 0 when
rank 0 stops the group and 1 when one of its ranks fails or rank 0 is gone. Rank 0 sees its
own node's rank processes die at once. A rank on another node beats a heartbeat into the
rendezvous store every HEARTBEAT_S seconds; rank 0 declares it lost when no beat has come
for LOST_AFTER_S (a machine that vanished, or a process stopped, leaves no closed
connection behind, and a collective would wait out --dist-timeout), or sooner when a
step's collective finds its connection broken.

The backend is gloo on CPU (NCCL would serve CUDA targets; not run on hardware yet). The
rendezvous is a TCP store on `--dist-init-addr` (host:port), or a free loopback port on
one node. Right after it, rank 0 broadcasts the KV pool's size, which every rank's pool
must share (page numbers in a step address all pools alike), and the context length (which
picks LongRoPE's table).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.args import ArgError
from kiln.core.lazy import lazy_module
from kiln.runtime import numa
from kiln.runtime.placement import Placement
from kiln.runtime.step import StepInputs

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
else:
    torch = lazy_module("torch")
    dist = lazy_module("torch.distributed")

log = logging.getLogger("kiln.parallel")

DEFAULT_TIMEOUT_S = 600
_STOP = -1
_CONTROL = -2  # a message for every rank follows, not a step (TPGroup.control)
_WATCH_S = 0.2  # how often rank 0 looks at the other ranks' processes
HEARTBEAT_S = 0.5  # how often a rank says it is alive
# A rank on another node not heard from for this long is lost. Far above a beat's period:
# a busy machine may run a beat late, never this late.
LOST_AFTER_S = 10.0


# What gloo says when a peer's connection breaks (its process or machine gone).
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def node_ranks(size: int, nnodes: int, node_rank: int) -> range:
    """The tensor-parallel ranks node `node_rank` of `nnodes` runs."""
    per = size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def check_nodes(size: int, nnodes: int, init_addr: str | None) -> None:
    """ArgError, naming the flags, for a node layout a `size`-rank artefact cannot take."""
    if nnodes == 1:
        return
    if size == 1:
        raise ArgError(
            f"--nnodes {nnodes}: the artefact has one rank (compile it with --tp-size to "
            "run its ranks on several machines)"
        )
    if size % nnodes:
        raise ArgError(
            f"--nnodes {nnodes}: the artefact's {size} tensor-parallel ranks do not split "
            f"evenly over {nnodes} nodes"
        )
    if not init_addr:
        raise ArgError(
            f"--nnodes {nnodes}: needs --dist-init-addr host:port, node 0's address as every "
            "node reaches it"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send(step: StepInputs | None, device: str) -> None:
    """The step's size (or _STOP), then the step (on the group's device: NCCL moves only
    GPU tensors)."""
    if step is None:
        dist.broadcast(torch.tensor([_STOP], device=device), src=0)
        return
    _broadcast_sized(step.encode(), device)


def _broadcast_sized(data: torch.Tensor, device: str) -> None:
    """An int64 tensor's length, then the tensor (rank 0's side of _receive_sized)."""
    dist.broadcast(torch.tensor([len(data)], device=device), src=0)
    dist.broadcast(data.to(device), src=0)


def _receive_sized(size: int, device: str) -> torch.Tensor:
    data = torch.empty(size, dtype=torch.long, device=device)
    dist.broadcast(data, src=0)
    return data.cpu()


def _spawn(
    artefact: Path,
    ranks: range,
    size: int,
    method: str,
    threads: Sequence[int],
    timeout_s: int,
    trust_remote_code: bool,
    numa_nodes: Sequence[int] | None = None,
    mapped: bool = True,
) -> list[subprocess.Popen[bytes]]:
    """The rank processes of `ranks`, this node's: their local ranks count from 0 at the
    node's first rank (each its own GPU on CUDA targets). `threads`: each one's kernel
    threads; `numa_nodes`: each one's NUMA node (--numa-node). `trust_remote_code`: the
    user's --trust-remote-code, which each rank needs to load native code built elsewhere
    just as rank 0 does; `mapped`: False, --weight-loader-disable-mmap."""
    trust = ["--trust-remote-code"] if trust_remote_code else []
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kiln.runtime.rank_worker",
                str(artefact),
                "--rank",
                str(rank),
                "--local-rank",
                str(rank - ranks.start),
                "--size",
                str(size),
                "--init-method",
                method,
                "--threads",
                str(threads[i]),
                "--timeout",
                str(timeout_s),
                *trust,
                *(["--numa-node", str(numa_nodes[i])] if numa_nodes else []),
                *([] if mapped else ["--weight-loader-disable-mmap"]),
            ]
        )
        for i, rank in enumerate(ranks)
    ]


def rendezvous_store(init_method: str, timeout_s: float) -> dist.TCPStore:
    """A client of the group's rendezvous store (tcp://host:port), for heartbeats."""
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class Heartbeat:
    """A rank's heartbeat: its count in the store, bumped every HEARTBEAT_S seconds on a
    thread of its own until the store is gone (rank 0 with it) or `stop`. A rank process
    stops it before it exits: a daemon thread still inside the store's C++ call (which lets
    go of the GIL) when the interpreter finalises is unwound through code that may not
    throw, and the process aborts (seen: a node's rank exiting with SIGABRT after its
    step loop had ended cleanly)."""

    def __init__(self, rank: int, store: dist.TCPStore) -> None:
        self._key, self._store = f"kiln/alive/{rank}", store
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store's host (rank 0) is gone: the step loop ends too
                return
            if self._stopped.wait(HEARTBEAT_S):
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=HEARTBEAT_S + 5.0)


class Heartbeats:
    """Rank 0's view of the other nodes' ranks: each one's beat count and when it last
    changed (on rank 0's clock, so no two machines' clocks are compared)."""

    def __init__(self, store: dist.TCPStore, ranks: list[int]) -> None:
        self.store = store
        now = time.monotonic()
        self.seen = {rank: (-1, now) for rank in ranks}

    def silent(self) -> list[tuple[int, float]]:
        """Ranks not heard from for LOST_AFTER_S, with how long they have been quiet."""
        now = time.monotonic()
        quiet = []
        for rank, (count, since) in self.seen.items():
            beats = int(self.store.add(f"kiln/alive/{rank}", 0))
            if beats != count:
                self.seen[rank] = (beats, now)
            elif now - since > LOST_AFTER_S:
                quiet.append((rank, now - since))
        return quiet


def receive(device: str) -> StepInputs | dict[str, Any] | None:
    """What rank 0 sends next: a step, a control message (a JSON object: data, never
    code), or None when the group stops."""
    size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if int(size) == _STOP:
        return None
    if int(size) == _CONTROL:
        dist.broadcast(size, src=0)
        message = json.loads(bytes(_receive_sized(int(size), device).tolist()).decode())
        assert isinstance(message, dict)
        return message
    return StepInputs.decode_from(_receive_sized(int(size), device))


def agree(ok: bool, device: str) -> bool:
    """Every rank says whether it did what a control message asked; True if all did."""
    flag = torch.tensor([int(ok)], dtype=torch.long, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag))


def init_group(backend: str, method: str, rank: int, size: int, timeout_s: float) -> None:
    """Join the tensor-parallel process group (the placement says gloo or NCCL)."""
    dist.init_process_group(
        backend,
        init_method=method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class TPGroup:
    """Rank 0's side: the other ranks' processes and the process group."""

    def __init__(
        self,
        artefact: Path,
        size: int,
        max_total_tokens: int,
        threads: Sequence[int],
        init_addr: str | None = None,
        timeout_s: int | None = None,
        nnodes: int = 1,
        placement: Placement | None = None,
        context_length: int = 0,
        trust_remote_code: bool = False,
        numa_nodes: Sequence[int] | None = None,
        mapped: bool = True,
    ) -> None:
        """`threads` and `numa_nodes`: each of this node's other ranks' kernel threads and
        NUMA node (--numa-node), in rank order."""
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process; shut it down "
                "(Engine.shutdown) before starting another"
            )
        self.nnodes = nnodes  # the layout is the Engine's to check (check_nodes)
        self.device = placement.device if placement else "cpu"
        backend = placement.backend if placement else "gloo"
        host, port = init_addr.rsplit(":", 1) if init_addr else ("127.0.0.1", _free_port())
        method = f"tcp://{host}:{port}"
        timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
        local = node_ranks(size, nnodes, 0)[1:]
        self.procs = _spawn(
            artefact,
            local,
            size,
            method,
            threads,
            int(timeout.total_seconds()),
            trust_remote_code,
            numa_nodes,
            mapped,
        )
        try:
            init_group(backend, method, 0, size, timeout.total_seconds())
            sizes = torch.tensor([max_total_tokens, context_length], device=self.device)
            dist.broadcast(sizes, src=0)
            remote = [r for r in range(1, size) if r not in local]
            self.heartbeats = Heartbeats(rendezvous_store(method, 30), remote) if remote else None
        except BaseException:
            self._reap(kill=True)
            raise
        self._closed = False
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="kiln-tp-watch", daemon=True).start()
        atexit.register(self.close)

    def _watch(self) -> None:
        while not self._stopped.wait(_WATCH_S):
            failure = self._dead_process() or self._silent_node()
            if failure is not None and not self._stopped.is_set():
                self._fail(failure)
                return

    def _dead_process(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}"
        return None

    def _silent_node(self) -> str | None:
        if self.heartbeats is None:
            return None
        try:
            quiet = self.heartbeats.silent()
        except Exception as e:  # the store runs in this process: this is a failure of ours
            return f"the tensor-parallel heartbeat store failed ({e})"
        if not quiet:
            return None
        rank, seconds = quiet[0]
        return (
            f"tensor-parallel rank {rank} on another node is gone (no heartbeat for "
            f"{seconds:.0f} s)"
        )

    def _fail(self, failure: str) -> None:
        self.failure = failure
        log.error("%s; stopping the other ranks", failure)
        self.abandon()
        if self.on_failure is not None:
            self.on_failure(failure)

    def lost_rank(self, error: BaseException | None = None) -> str | None:
        """After a step failed with `error`: the rank that died, if one did (its exit is
        waited for a moment: a peer's closed connection can be seen before its process is
        reaped), or a rank on another node whose connection broke."""
        for rank, p in enumerate(self.procs, start=1):
            try:
                code = p.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}"
        if self.failure is None and self.nnodes > 1 and any(x in str(error) for x in _LOST):
            self._fail(f"a tensor-parallel rank on another node is gone ({error})")
        return self.failure

    def send(self, step: StepInputs) -> None:
        self._check()
        _send(step, self.device)

    def control(self, message: dict[str, Any]) -> bool:
        """Tell every other rank `message` (between steps, in the steps' order; rank_worker
        handles it) and wait for their answer: True when every rank did it."""
        self._check()
        dist.broadcast(torch.tensor([_CONTROL], device=self.device), src=0)
        _broadcast_sized(torch.tensor(list(json.dumps(message).encode())), self.device)
        return agree(True, self.device)

    def _check(self) -> None:
        if self.failure is not None:  # the watcher found a rank lost: no step can run
            raise RuntimeError(self.failure)
        dead = [p.pid for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process(es) {dead} exited")

    def abandon(self) -> None:
        """Stop the ranks that are left without talking to them (one is gone, so a
        collective could wait out the timeout); the group is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        atexit.unregister(self.close)
        self._reap(kill=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        atexit.unregister(self.close)
        try:
            if all(p.poll() is None for p in self.procs):
                _send(None, self.device)
        except RuntimeError:  # a rank already gone: the others are reaped below
            pass
        self._reap(kill=False)
        dist.destroy_process_group()

    def _reap(self, kill: bool) -> None:
        for p in self.procs:
            if kill:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def follow(
    artefact: Path,
    size: int,
    nnodes: int,
    node_rank: int,
    init_addr: str | None,
    timeout_s: int | None,
    threads: int | None,
    trust_remote_code: bool = False,
    numa_node: Sequence[int] | None = None,
    mapped: bool = True,
) -> int:
    """Node `node_rank` (> 0) of a multi-node group: run this node's ranks until rank 0
    stops them (0), or one fails or rank 0 is gone (1); SIGTERM / SIGINT stop them (0).
    The caller checked the artefact's files here (each node has its own copy).
    `numa_node`: --numa-node, one NUMA node per rank of this node."""
    check_nodes(size, nnodes, init_addr)
    ranks = node_ranks(size, nnodes, node_rank)
    nodes = None
    if numa_node:
        nodes = numa.check(numa_node, len(ranks), f"{len(ranks)} tensor-parallel rank(s)")
    if nodes and not threads:  # each rank its node's share of cores (runtime/numa.py)
        per_rank = numa.shares(nodes)
    else:
        per_rank = [max(1, (threads or torch.get_num_threads()) // len(ranks))] * len(ranks)
    timeout = timeout_s or DEFAULT_TIMEOUT_S
    procs = _spawn(
        artefact,
        ranks,
        size,
        f"tcp://{init_addr}",
        per_rank,
        timeout,
        trust_remote_code,
        nodes,
        mapped,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.warning(
        "node %d of %d: tensor-parallel rank(s) %s, rendezvous at %s (node 0 serves HTTP)",
        node_rank,
        nnodes,
        ", ".join(map(str, ranks)),
        init_addr,
    )
    failed: str | None = None
    while not stop.wait(_WATCH_S):
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in zip(ranks, codes, strict=True) if c not in (None, 0)]
        if bad:
            failed = ", ".join(f"rank {r} exited with code {c}" for r, c in bad)
            break
        if all(c == 0 for c in codes):  # rank 0 stopped the group
            return 0
    for p in procs:
        p.kill()
        p.wait()
    if failed:
        log.error("node %d: %s; its other ranks are stopped", node_rank, failed)
        return 1
    return 0
