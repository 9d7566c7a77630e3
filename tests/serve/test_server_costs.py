"""What a client costs the others, and what an idle server costs the machine (issue 23,
items 11-13): one shared /health_generate probe, no Nagle wait on kept-alive connections,
KV memory given back."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from serve_helpers import API_KEY, generated_tokens

from kiln.serve.context import HEALTH_PROBE_SECONDS
from kiln.serve.server import bind

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(artefact, launch):
    return launch(
        artefact("llama"), "--api-key", API_KEY, "--enable-metrics", "--max-total-tokens", "4096"
    )


# -- item 11: /health_generate is public, so its callers share one probe ---------------------
def test_health_generate_callers_share_one_probe_a_second(server) -> None:
    before = generated_tokens(server)
    keyed = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[list[int]], httpx.Response, float]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            start = time.monotonic()

            async def loop() -> list[int]:
                codes = []
                while time.monotonic() - start < 3:
                    codes.append((await c.get("/health_generate")).status_code)
                return codes

            stream = asyncio.ensure_future(
                c.post(
                    "/generate",
                    headers=AUTH,
                    json={"input_ids": [1, 2, 3], "sampling_params": keyed},
                )
            )
            codes = await asyncio.gather(*(loop() for _ in range(32)))
            return codes, await stream, time.monotonic() - start

    codes, keyed_reply, elapsed = asyncio.run(run())
    calls = sum(map(len, codes))
    assert keyed_reply.status_code == 200 and len(keyed_reply.json()["output_ids"]) == 40
    assert all(code == 200 for loop in codes for code in loop)
    probes = generated_tokens(server) - before - 40  # each probe generates one token
    # 32 callers in a loop made hundreds of calls; the engine ran about one probe a second.
    assert calls > 3 * 32, calls
    assert 1 <= probes <= elapsed / HEALTH_PROBE_SECONDS + 2, (probes, elapsed, calls)


# -- item 12: no Nagle wait on a kept-alive connection ----------------------------------------
def test_the_listening_socket_is_tcp_with_nodelay() -> None:
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def test_kept_alive_requests_do_not_wait_for_a_delayed_ack(server) -> None:
    """A small JSON response on a kept-alive connection took ~44 ms (Nagle's algorithm
    waiting for the client's delayed ACK, 40 ms) against a few ms on a new connection."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        c.get("/get_model_info")  # opens the connection
        info = []
        for _ in range(15):
            t0 = time.perf_counter()
            assert c.get("/get_model_info").status_code == 200
            info.append(time.perf_counter() - t0)
        chat = []
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for _ in range(11):
            t0 = time.perf_counter()
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            chat.append(time.perf_counter() - t0)
    # A Nagle wait adds ~40 ms to every request on the connection (each of 15 info calls
    # took 42-48 ms with it, a chat call's own time ~15-20 ms more); a busy machine slows
    # most (a CI run with a test beside it had one chat call of 11 under 35 ms, the next
    # at 37.5): so the two fastest must be faster than any call that waited.
    assert sorted(info)[1] < 0.030, info
    assert sorted(chat)[1] < 0.045, chat
