"""A tensor-parallel artefact behind the OpenAI server: rank 0 serves, rank 1 is its own
process, and nothing is left running after the server stops."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
from serve_helpers import API_KEY, start_server, stop_server

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model

PROMPT = list(range(3, 43))
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _ranks_of(art: Path) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"kiln.runtime.parallel {art}"], capture_output=True, text=True
    )
    return [int(x) for x in found.stdout.split()]


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
