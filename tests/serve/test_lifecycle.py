"""Starting and stopping `kiln serve` as a process manager does: the port is checked
first, SIGTERM ends streams with a final event and exits 0, and draining is available."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serve_helpers import free_port, start_kiln, start_server, stop_server, wait_until_running

from kiln import Engine
from kiln.runtime.engine_thread import TORCH_PREFETCH_IDLE_S

LONG = {"max_new_tokens": 1200, "ignore_eos": True, "temperature": 0}


async def _stream(c: httpx.AsyncClient) -> list[str]:
    body = {"text": "Hello", "sampling_params": LONG, "stream": True}
    async with c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line.startswith("data: ")]


async def _signal_mid_stream(server, sig: int, streams: int) -> tuple[list[list[str]], int]:
    """Start `streams` long streams and one non-streaming request, send `sig` once they
    run, and return the streams' lines and the non-streaming status."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
        tasks = [asyncio.ensure_future(_stream(c)) for _ in range(streams)]
        plain = asyncio.ensure_future(
            c.post("/generate", json={"text": "Hi", "sampling_params": LONG})
        )
        await wait_until_running(c, streams + 1)
        server.process.send_signal(sig)
        return await asyncio.gather(*tasks), (await plain).status_code


def test_sigterm_mid_stream_ends_each_stream_with_an_error_then_exits_0(artefact, tmp_path):
    art = artefact("llama", max_position_embeddings=8192)
    server = start_server(art, tmp_path / "log", "--max-total-tokens", "16384")
    results, plain = asyncio.run(_signal_mid_stream(server, signal.SIGTERM, 3))
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        final = json.loads(lines[-2][6:])
        assert final["error"]["code"] == 503 and "shutting down" in final["error"]["message"]
    assert plain == 503
    assert server.process.wait(timeout=30) == 0


def test_shutdown_timeout_lets_requests_in_flight_finish(artefact, tmp_path):
    art = artefact("llama", max_position_embeddings=8192)
    server = start_server(
        art, tmp_path / "log", "--max-total-tokens", "16384", "--shutdown-timeout", "60"
    )

    async def run() -> tuple[list[list[str]], int, int, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            tasks = [asyncio.ensure_future(_stream(c)) for _ in range(2)]
            await wait_until_running(c, 2)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = (await c.get("/health")).status_code
            late = await c.post("/generate", json={"text": "x", "sampling_params": LONG})
            return await asyncio.gather(*tasks), health, late.status_code, server.process.poll()

    results, health, late, still_running = asyncio.run(run())
    assert health == 503 and late == 503 and still_running is None
    for lines in results:
        final = json.loads(lines[-2][6:])
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        assert len(final["output_ids"]) == LONG["max_new_tokens"]
    assert server.process.wait(timeout=30) == 0


def test_idle_sigterm_and_sigint_exit_0(artefact, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = start_server(
            artefact("llama"), tmp_path / f"log{sig}", "--max-total-tokens", "256"
        )
        server.process.send_signal(sig)
        assert server.process.wait(timeout=30) == 0
        assert "Application shutdown complete" in server.log.read_text()


def test_a_port_in_use_is_one_line_before_loading_anything(artefact):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "kiln", "serve", str(artefact("llama")), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"kiln serve: error: --port {port}: cannot listen on 127.0.0.1:{port}: "
        "Address already in use"
    ]
    assert "startup complete" not in r.stdout + r.stderr
    assert time.perf_counter() - t0 < 10


def test_a_damaged_artefact_is_one_line_with_its_checksums_checked_early(damaged_llama):
    """`kiln serve` checks the files' checksums on a thread beside its imports (kiln/cli.py):
    a damaged weight file still stops it with one line, before it listens."""
    art = damaged_llama
    port = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", str(art), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1:] == [
        f"kiln serve: error: {art}: weights/rank0.safetensors is damaged (checksum mismatch)"
    ], r.stderr
    assert "startup complete" not in r.stdout + r.stderr


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_idle_memory_startup_line_and_threads(artefact, tmp_path):
    """Default KV pool (30% of free RAM) reserved but committed only as used; one line
    says what runs; --threads sets the kernel threads."""
    import re

    # A long context makes the default pool as large as the memory budget allows (GiBs).
    art = artefact("llama", max_position_embeddings=131072)
    server = start_server(art, tmp_path / "log", "--threads", "1")
    try:
        rss = _rss_mb(server.process.pid)
        log = server.log.read_text()
        info = server.get("/get_server_info").json()
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
    assert rss < 800, f"an idle server of a 1 MB model holds {rss:.0f} MB"
    line = re.search(r"kiln\.engine: (.*)", log).group(1)
    assert re.fullmatch(
        r"\S+: float32 on cpu; decode: native step; kernels: .*linear kiln_cpu.*; "
        r"KV pool: \d+ tokens "
        r"\(\d+ pages of 1\), [\d.]+ GiB reserved, committed as used; threads: 1 \(--threads\)",
        line,
    ), line
    assert info["threads"] == 1
    reserved = float(re.search(r"([\d.]+) GiB reserved", line).group(1))
    assert reserved > 1.0, "the test needs a pool larger than what it may hold"


# Runs kiln's CLI; at exit, writes the kiln modules that were imported (and torch, if),
# and "gc.isenabled()" if the cyclic garbage collector is on.
_MODULE_PROBE = """
import atexit, gc, json, sys
out = sys.argv.pop(1)
if sys.argv[1] == "--prefetch-idle":
    sys.argv.pop(1)
    import kiln.runtime.engine_thread
    kiln.runtime.engine_thread.TORCH_PREFETCH_IDLE_S = float(sys.argv.pop(1))
def dump():
    on = ["gc.isenabled()"] if gc.isenabled() else []
    with open(out, "w") as f:
        json.dump(sorted(m for m in sys.modules if m.startswith("kiln") or m == "torch") + on, f)
atexit.register(dump)
from kiln.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serving_never_imports_models_or_passes(artefact, tmp_path) -> None:
    """What the runtime needs is in the artefact: loading it and serving a request imports
    neither the model definitions nor the compiler passes."""
    dump = tmp_path / "modules.json"
    server = start_kiln(
        ["serve", str(artefact("llama")), "--max-total-tokens", "512"],
        tmp_path / "serve.log",
        launcher=("-c", _MODULE_PROBE, str(dump)),
    )
    try:
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3}}
        assert server.post("/generate", json=body).status_code == 200
    finally:
        stop_server(server)
    modules = json.loads(dump.read_text())
    assert "kiln.runtime.engine" in modules and "kiln.serve.app" in modules
    assert not [m for m in modules if m.startswith(("kiln.models", "kiln.passes"))], modules
    assert "kiln.compiler.compile" not in modules
    # `kiln serve` starts without cyclic collections; the server turns them back on.
    assert "gc.isenabled()" in modules


def test_a_native_step_artefact_serves_without_torch_until_a_request_needs_it(
    artefact, tmp_path
) -> None:
    """Start to first token: torch's import alone is 2.0-2.4 s of a 3.8 s start on a 2-core
    Zen 3. A CPU artefact whose every step is native loads as numpy views (runtime/
    weights.py), and requests without a grammar (greedy, sampled, penalised, with
    suppressed tokens or logprobs) are served with torch never imported (runtime/
    sampler.py chooses those rows in numpy), so none of them stalls the engine thread for
    torch's import; a grammar (xgrammar's matchers are torch's) imports it, and its tokens
    are an in-process engine's; a server that has answered and then idles imports it in
    the background (runtime/engine_thread.py)."""
    art = artefact("llama")

    def serve(*requests: dict, name: str, idle: float = 0) -> tuple[list[dict], list[str]]:
        # Without an idle wait the background import is held off: on a loaded machine the
        # gap between two requests, or the server's own shutdown, can outlast its 0.5 s.
        dump = tmp_path / f"{name}.json"
        prefetch = () if idle else ("--prefetch-idle", "3600")
        server = start_kiln(
            ["serve", str(art), "--max-total-tokens", "512"],
            tmp_path / f"{name}.log",
            launcher=("-c", _MODULE_PROBE, str(dump), *prefetch),
        )
        try:
            answers = []
            for body in requests:
                r = server.post("/generate", json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json())
            time.sleep(idle)
        finally:
            stop_server(server)
        return answers, json.loads(dump.read_text())

    greedy = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    sampled = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 3}
    drawn = {"input_ids": [5, 6, 7], "sampling_params": sampled}
    penalised = {
        "input_ids": [5, 6, 7],
        "sampling_params": sampled | {"frequency_penalty": 1, "min_new_tokens": 3},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    constrained = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": "(ab|cd)+"},
    }
    [plain, once, penalty], modules = serve(greedy, drawn, penalised, name="greedy")
    assert "kiln.runtime.native_step" in modules
    assert "torch" not in modules, "a request without a grammar imported torch"
    assert penalty["meta_info"]["output_top_logprobs"][0]
    [again, grammar], modules = serve(greedy, constrained, name="grammar")
    assert "torch" in modules
    engine = Engine(art, max_total_tokens=512)
    for got, body in ((once, drawn), (penalty, penalised), (grammar, constrained)):
        want = engine.generate(input_ids=body["input_ids"], sampling_params=body["sampling_params"])
        assert got["output_ids"] == want["output_ids"]
    assert again["output_ids"] == plain["output_ids"]
    _, modules = serve(greedy, name="idle", idle=TORCH_PREFETCH_IDLE_S + 4)
    assert "torch" in modules, "an idle server did not import torch in the background"
