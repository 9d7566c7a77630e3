"""What stalls a server, watched: --watchdog-timeout and --soft-watchdog-timeout
(runtime/watchdog.py): a step past the soft limit is logged with the engine thread's stack
and the server goes on; past the hard limit the clients are answered and the server exits
1. --gc-warning-threshold-secs (runtime/gc_watch.py): long garbage collections are logged.
Tiny limits make every step of a long generation, and every collection, overrun them."""

from __future__ import annotations

import json
import time

from serve_helpers import API_KEY
from tokenizers import Tokenizer

LONG = {
    "model": "default",
    "prompt": "Hello",
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
}


def test_a_step_past_the_soft_limit_is_logged_and_the_server_goes_on(artefact, launch) -> None:
    server = launch(
        artefact("llama"), "--api-key", API_KEY, "--skip-server-warmup",
        "--soft-watchdog-timeout", "1e-6",
    )  # fmt: skip
    answer = server.post("/v1/completions", json={**LONG, "max_tokens": 20}).json()
    assert answer["usage"]["completion_tokens"] == 20  # (each step logs a stack: few steps)
    log = server.log.read_text()
    assert "a step has run for" in log and "(--soft-watchdog-timeout 1e-06)" in log
    assert "the engine thread:" in log and "in step" in log  # its Python stack
    assert server.get("/health").status_code == 200


def test_a_step_past_the_hard_limit_ends_the_server(artefact, launch, tmp_path) -> None:
    server = launch(
        artefact("llama"), "--api-key", API_KEY, "--skip-server-warmup",
        "--watchdog-timeout", "1e-6", "--crash-dump-folder", str(tmp_path / "dumps"),
    )  # fmt: skip
    r = server.post("/v1/completions", json=LONG)
    assert r.status_code == 503 and "--watchdog-timeout 1e-06" in r.json()["error"]["message"]
    deadline = time.monotonic() + 30
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.process.returncode == 1  # a supervisor restarts it
    log = server.log.read_text()
    assert "without returning (--watchdog-timeout 1e-06); the server stops" in log
    assert "running requests (1)" in log
    # --crash-dump-folder: the request in flight, to replay; the API key left out
    [dump] = (tmp_path / "dumps").glob("*/crash_dump_*.json")
    assert "dumped 0 ended and 1 unfinished requests before the failure to" in log
    record = json.loads(dump.read_text())
    assert "--watchdog-timeout 1e-06" in record["reason"]
    assert record["server_args"]["watchdog_timeout"] == 1e-6
    assert API_KEY not in dump.read_text()
    [req] = record["requests"]
    assert req["finished"] is False and req["sampling_params"]["max_new_tokens"] == 200
    tokenizer = Tokenizer.from_file(str(artefact("llama") / "tokenizer/tokenizer.json"))
    assert req["input_ids"] == tokenizer.encode("Hello").ids


def test_long_collections_are_logged_and_freeze_gc_answers(artefact, launch) -> None:
    """--gc-warning-threshold-secs: with a threshold every collection passes, serving a
    request logs them; /freeze_gc (SGLang's route) answers as SGLang's does."""
    server = launch(
        artefact("llama"), "--api-key", API_KEY, "--skip-server-warmup",
        "--gc-warning-threshold-secs", "1e-9",
    )  # fmt: skip
    server.post("/v1/completions", json={**LONG, "max_tokens": 50})
    r = server.post("/freeze_gc")
    assert r.status_code == 200 and r.text == "Garbage collection frozen.\n"
    log = server.log.read_text()
    assert "garbage collection of generation" in log
    assert "(--gc-warning-threshold-secs 1e-09); objects tracked: gen0=" in log
    assert "garbage collector: froze" in log
