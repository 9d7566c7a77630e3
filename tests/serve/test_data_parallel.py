"""--dp-size 2: two replicas behind SGLang's router (the sglang-router package), real processes
on loopback: the same greedy text from either, both serve, --api-key holds through the router,
SIGTERM stops everything with 0, and a replica that dies takes the endpoint down with 1."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from serve_helpers import ADMIN_KEY, API_KEY, metric, start_server, stop_server

from kiln import Engine
from kiln.runtime import numa

PROMPT = "The kiln"


def _replicas(server) -> list[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"data-parallel replicas \(([^)]*)", server.log.read_text())
        if found:
            return [u.strip() for u in found.group(1).split(",")][:2]
        time.sleep(0.1)
    raise AssertionError(server.log.read_text()[-2000:])


def _served(url: str) -> float:
    return metric(httpx.get(url + "/metrics", timeout=10).text, "kiln:num_requests_total")


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in found.stdout.split()]


def test_two_replicas_behind_sglangs_router(artefact, tmp_path: Path) -> None:
    art = artefact("llama")
    [want] = Engine(art, max_total_tokens=512).generate(
        [PROMPT], sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    )
    flags = ("--dp-size", "2", "--api-key", API_KEY, "--enable-metrics")  # replicas take both
    # and --numa-node: replica r's rank takes element r (both node 0: it is on every machine)
    server = start_server(art, tmp_path / "dp.log", *flags, "--numa-node", "0", "0")
    try:
        urls = _replicas(server)
        children = _children(server.process.pid)
        assert len(children) == 3  # two replicas and the router
        bound = [p for p in children if " prefer:0 " in Path(f"/proc/{p}/numa_maps").read_text()]
        assert len(bound) == 2  # the replicas (the router is not kiln's to bind)
        share = max(1, numa.shares([0])[0] // 2)  # node 0's cores shared by the two
        assert f"{share}/{share} threads" in server.log.read_text()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        before = [_served(u) for u in urls]  # each replica's own warm-up request
        for _ in range(4):
            reply = client.completions.create(
                model="m",
                prompt=PROMPT,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert reply.choices[0].text == want["text"]
        assert [_served(u) - b for u, b in zip(urls, before, strict=True)] == [2, 2]
        # SGLang's native /generate through the router, which adds its own fields (model,
        # return_bytes, return_entropy) to the body it forwards: they were refused once
        body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                "ignore_eos": True}}  # fmt: skip
        native = httpx.post(server.url + "/generate", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        assert native.status_code == 200 and native.json()["text"] == want["text"], native.text
        # and the Responses API, whose bodies the router fills with SGLang's sampling fields
        # (top_k, min_p, repetition_penalty, priority) and a null stream
        reply = client.responses.create(model="m", input=PROMPT, max_output_tokens=4)
        assert reply.status in ("completed", "incomplete") and reply.output_text
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong")
        try:
            bad.completions.create(model="m", prompt=PROMPT, max_tokens=1)
            raise AssertionError("a wrong key was let through")
        except openai.AuthenticationError:
            pass
    finally:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=90)
    assert code == 0, server.log.read_text()[-2000:]
    assert _children(server.process.pid) == []
    # --load-balance-method shortest_queue: with one request held on a paused replica, the
    # next ones all go to the other (round-robin would send every other one to the held
    # replica, where it would wait); then a replica killed: the endpoint goes down with
    # exit 1 and nothing is left
    flags = ("--dp-size", "2", "--load-balance-method", "shortest_queue", "--enable-metrics")
    server = start_server(art, tmp_path / "dp2.log", *flags, "--admin-api-key", ADMIN_KEY)
    try:
        _shortest_queue(server, want["text"])
        replica = _children(server.process.pid)[0]
        subprocess.run(["kill", "-9", str(replica)], check=True)
        code = server.process.wait(timeout=90)
    finally:
        if server.process.poll() is None:
            stop_server(server)
    log = server.log.read_text()
    assert code == 1, log[-2000:]
    assert "exited with code -9; the other replicas and the router are stopped" in log


def _load(url: str) -> int:
    return int(httpx.get(url + "/get_load", timeout=10).json()[0]["num_reqs"])


def _shortest_queue(server, text: str) -> None:
    urls = _replicas(server)
    before = [_served(u) for u in urls]
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for u in urls:
        paused = httpx.post(u + "/pause_generation", json={}, headers=admin, timeout=10)
        assert paused.status_code == 200, paused.text
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
            "ignore_eos": True}}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, server.url + "/generate", json=body, timeout=120)
        deadline = time.monotonic() + 30
        while sum(map(_load, urls)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = [_load(u) for u in urls].index(1)
        idle = urls[1 - busy]
        resumed = httpx.post(idle + "/continue_generation", headers=admin, timeout=10)
        assert resumed.status_code == 200, resumed.text
        for _ in range(3):
            r = httpx.post(server.url + "/generate", json=body, timeout=20)
            assert r.status_code == 200 and r.json()["text"] == text, r.text
        served = [_served(u) - b for u, b in zip(urls, before, strict=True)]
        assert served[1 - busy] == 3 and _load(urls[busy]) == 1, served
        httpx.post(urls[busy] + "/continue_generation", headers=admin, timeout=10)
        assert held.result().json()["text"] == text
