"""Starting and stopping a real `kiln serve` process on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

API_KEY = "test-key"
ADMIN_KEY = "admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, key: str | None = API_KEY, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=_auth(key, kw), timeout=60, **kw)

    def post(self, path: str, key: str | None = API_KEY, **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers=_auth(key, kw), timeout=60, **kw)


def _auth(key: str | None, kw: dict) -> dict[str, str]:
    headers = dict(kw.pop("headers", {}))
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


async def wait_until_running(client: httpx.AsyncClient, count: int, timeout: float = 60) -> None:
    """Poll /get_server_info until `count` requests run at once; fail (not hang) when they
    never do within `timeout` seconds (streams that end before the last one starts)."""
    deadline, most = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        running = (await client.get("/get_server_info")).json()["num_running_reqs"]
        if running >= count:
            return
        most = max(most, running)
        await asyncio.sleep(0.005)
    raise AssertionError(f"{count} requests never ran at once within {timeout} s (at most {most})")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a /metrics text's samples called `name` whose labels include `labels`
    (Prometheus's own parser); KeyError when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    if not found:
        raise KeyError(f"no sample {name} {labels or ''} in /metrics")
    return sum(found)


def generated_tokens(server: Server) -> float:
    """kiln:generation_tokens_total from the server's /metrics (--enable-metrics)."""
    return metric(server.get("/metrics", key=None).text, "kiln:generation_tokens_total")


def stream_completions(server: Server, prompts: list[str], max_tokens: int) -> list[str]:
    """Every prompt streamed at once through the async openai client (greedy, ignore_eos,
    served model name "tiny"): each stream's text."""

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(run())


def start_server(art: Path, log: Path, *flags: str) -> Server:
    return start_kiln(["serve", str(art), *flags], log)


def start_kiln(argv: list[str], log: Path, launcher: tuple[str, ...] = ("-m", "kiln")) -> Server:
    """Run `kiln ARGV --port P` and wait until /health answers. `launcher`: what follows
    the interpreter in place of `-m kiln` (a `-c` script that runs kiln's main)."""
    port = free_port()
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, *launcher, *argv, "--port", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited early:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Server(url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"kiln serve did not come up:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    """SIGTERM, as a process manager sends it: the server shuts down and exits 0."""
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=30)
    log = server.log.read_text()
    assert code == 0, log[-2000:]
    assert "Application shutdown complete" in log, log[-2000:]
