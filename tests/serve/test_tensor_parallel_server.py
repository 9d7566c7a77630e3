"""A tensor-parallel artefact behind the OpenAI server: rank 0 serves, rank 1 is its own
process, and nothing is left running after the server stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import API_KEY, free_port, start_server, stop_server

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model
from kiln.runtime.parallel import LOST_AFTER_S

PROMPT = list(range(3, 43))
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _ranks_of(art: Path) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"kiln.runtime.rank_worker {art}"], capture_output=True, text=True
    )
    return [int(x) for x in found.stdout.split()]


def _ranks_gone(art: Path, within_s: float = 10.0) -> list[int]:
    """The rank processes of `art` still running after up to `within_s` (a process just sent
    SIGKILL can still be listed for a moment before the kernel has torn it down)."""
    deadline = time.monotonic() + within_s
    while (left := _ranks_of(art)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_tp2_server_answers_as_tp1_and_leaves_no_rank_behind(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = checkpoint("llama", num_kv_heads=4)
    arts = {tp: tmp_path / f"tp{tp}" for tp in (1, 2)}
    for tp, art in arts.items():
        compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=tp), art)
    [want] = Engine(arts[1], max_total_tokens=1024).generate(
        input_ids=[PROMPT], sampling_params=GREEDY
    )
    server = start_server(arts[2], tmp_path / "server.log", "--api-key", API_KEY)
    try:
        assert len(_ranks_of(arts[2])) == 1  # rank 1's process; rank 0 is the server
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        reply = client.completions.create(model="tp2", prompt=PROMPT, max_tokens=16, temperature=0)
        assert reply.choices[0].text == want["text"]
    finally:
        stop_server(server)
    assert _ranks_of(arts[2]) == []
    # Ctrl-C (SIGINT) stops it the same way: exit 0, rank 1 gone
    server = start_server(arts[2], tmp_path / "server2.log", "--api-key", API_KEY)
    try:
        assert len(_ranks_of(arts[2])) == 1
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 0, server.log.read_text()[-2000:]
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert _ranks_of(arts[2]) == []


def test_a_rank_killed_mid_stream_ends_the_stream_and_the_server_exits_1(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # SIGKILL, as the OOM killer sends it: no goodbye from the rank. The stream in flight
    # ends (an error event or a closed connection, not a hang), /health is 503 or the
    # server is gone, the server exits 1 naming the rank, and no rank process is left.
    ckpt = checkpoint("llama", num_kv_heads=4)
    art = tmp_path / "tp2"
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=2), art)
    server = start_server(art, tmp_path / "server.log", "--api-key", API_KEY)
    try:
        [rank1] = _ranks_of(art)
        body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        events: list[str] = []
        done = threading.Event()

        def read_stream() -> None:
            try:
                with httpx.stream(
                    "POST",
                    server.url + "/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    timeout=60,
                ) as r:
                    events.extend(r.iter_lines())
            except httpx.HTTPError as e:
                events.append(f"closed: {e!r}")
            done.set()

        threading.Thread(target=read_stream, daemon=True).start()
        deadline = time.monotonic() + 30
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(events) >= 2, "the stream did not start"
        os.kill(rank1, signal.SIGKILL)
        started = time.monotonic()
        health = []
        while server.process.poll() is None and time.monotonic() - started < 30:
            try:
                health.append(httpx.get(server.url + "/health", timeout=1).status_code)
            except httpx.HTTPError:
                health.append(0)  # no server listening any more
            time.sleep(0.05)
        code = server.process.wait(timeout=30)
        elapsed = time.monotonic() - started
        assert done.wait(10), "the stream was left hanging"
    finally:
        if server.process.poll() is None:
            server.process.kill()
    log = server.log.read_text()
    assert code == 1, log[-2000:]
    assert elapsed < 20, f"exit took {elapsed:.1f}s"
    assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in log, log[-2000:]
    # unhealthy (503, then nobody listening) from the moment the kill was seen, for good
    seen = next((i for i, c in enumerate(health) if c != 200), None)
    assert seen is not None and 200 not in health[seen:], health
    # the stream's end: an error event naming the rank (then [DONE]), or a closed connection
    tail = " ".join(e for e in events[-6:] if e.strip())
    assert "closed" in tail or "exited with code -9" in tail, events[-6:]
    assert _ranks_of(art) == []


def _node(art: Path, rank: int, addr: str, log: Path, *more: str) -> subprocess.Popen[bytes]:
    """`kiln serve` of a node other than node 0: its ranks, no HTTP."""
    flags = ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr, *more]
    return subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", str(art), *flags],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in found.stdout.split()]


def test_two_nodes_serve_as_tp1_and_stop_together(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """--nnodes 2 on localhost: node 1's `kiln serve` runs rank 1 (no HTTP), node 0's is
    rank 0 and the server. Greedy text as tp=1; SIGTERM to node 0 stops node 1 (exit 0);
    a rank of node 1 killed, or stopped (a vanished machine: only the heartbeat finds it),
    takes node 0's server down (exit 1) with a 503 for the request in flight, within the
    heartbeat's bound."""
    ckpt = checkpoint("llama", num_kv_heads=4)
    arts = {tp: tmp_path / f"tp{tp}" for tp in (1, 2)}
    for tp, art in arts.items():
        compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=tp), art)
    engine = Engine(arts[1], max_total_tokens=1024)
    [want] = engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)
    for flags, error in (
        ({"nnodes": 2}, "--nnodes 2: the artefact has one rank"),
        ({"nnodes": 2, "node_rank": 1}, "--node-rank 1: an engine is rank 0"),
    ):
        with pytest.raises(ArgError, match=error):
            Engine(arts[1], dist_init_addr="127.0.0.1:1", **flags)
    with pytest.raises(ArgError, match="needs --dist-init-addr host:port"):
        Engine(arts[2], nnodes=2, max_total_tokens=256)

    for round_ in ("stop", "crash", "stall"):
        addr = f"127.0.0.1:{free_port()}"
        # --numa-node on node 1: its rank (its first) on its NUMA node 0
        numa = ("--numa-node", "0") if round_ == "stop" else ()
        node1 = _node(arts[2], 1, addr, tmp_path / f"node1-{round_}.log", *numa)
        flags = ("--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr)
        server = None
        rank1 = None
        try:
            server = start_server(arts[2], tmp_path / f"node0-{round_}.log", *flags)
            assert _children(server.process.pid) == []  # node 0 runs rank 0 alone
            [rank1] = _children(node1.pid)
            if round_ == "stop":
                assert " prefer:0 " in Path(f"/proc/{rank1}/numa_maps").read_text()
                reply = server.post(
                    "/v1/completions",
                    key=None,
                    json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                ).json()
                assert reply["choices"][0]["text"] == want["text"]
                stop_server(server)
                assert node1.wait(timeout=30) == 0, (tmp_path / "node1-stop.log").read_text()
                continue
            # crash: the rank's process is gone (its connections close); stall: it stops
            # answering with its connections open, as a machine that vanished leaves them,
            # which only the heartbeat finds. Either way: a 503 within the bound.
            os.kill(rank1, signal.SIGKILL if round_ == "crash" else signal.SIGSTOP)
            start = time.monotonic()
            r = server.post("/generate", key=None, json={"input_ids": PROMPT})
            assert r.status_code == 503 and "another node is gone" in r.text, r.text
            assert time.monotonic() - start < LOST_AFTER_S + 10
            assert server.process.wait(timeout=30) == 1
            if round_ == "crash":
                assert node1.wait(timeout=30) == 1
        finally:
            if round_ == "stall" and rank1 is not None:
                os.kill(rank1, signal.SIGKILL)
            for p in (node1, server and server.process):
                if p is not None and p.poll() is None:
                    p.kill()
        assert _ranks_gone(arts[2]) == []
