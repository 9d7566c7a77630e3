"""--log-requests: one line as each request ends, at SGLang's levels, as text or JSON."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import API_KEY

from kiln import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve import replay, request_log
from kiln.serve.request_log import CrashDump, RequestLog


def test_a_served_request_is_logged_whole_at_level_3_as_json(artefact, launch) -> None:
    server = launch(
        artefact("llama"),
        "--api-key",
        API_KEY,
        "--log-requests",
        "--log-requests-level",
        "3",
        "--log-requests-format",
        "json",
    )
    body = {"model": "default", "prompt": "Hello there", "max_tokens": 5, "temperature": 0}
    answer = server.post("/v1/completions", json={**body, "rid": "mine"}).json()
    # a client that goes away mid-stream is logged too, with why it ended
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**body, "max_tokens": 200, "stream": True, "ignore_eos": True, "rid": "gone"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        next(r.iter_lines())
    server.post("/v1/completions", json=body)  # the abort is logged by the time this ends
    logged: dict[str, dict] = {}
    deadline = time.monotonic() + 10  # the lines are written on the server's log thread
    while len(logged) < 3 and time.monotonic() < deadline:
        lines = [ln.split("kiln.requests: ", 1)[1] for ln in server.log.read_text().splitlines()
                 if "kiln.requests: " in ln]  # fmt: skip
        logged = {e["rid"]: e for e in map(json.loads, lines)}
        time.sleep(0.05)
    mine = logged["mine"]
    assert mine["output"] == answer["choices"][0]["text"]
    assert mine["input"].endswith("Hello there")  # as the model saw it: BOS first
    assert mine["completion_tokens"] == 5 == answer["usage"]["completion_tokens"]
    assert mine["sampling_params"]["max_new_tokens"] == 5
    assert mine["finish_reason"]["type"] == "length" and mine["e2e_latency"] > 0
    assert logged["gone"]["finish_reason"]["message"] == "the client went away"


@pytest.mark.parametrize("level", [0, 1, 2])
def test_levels_say_more_and_cut_the_text(artefact, caplog, level: int) -> None:
    engine = Engine(artefact("llama"), max_total_tokens=1024)
    prompt = list(range(3, 200))
    req = engine.make_request(prompt, SamplingParams(max_new_tokens=2, temperature=0))
    engine._run([req])
    with caplog.at_level(logging.INFO, logger="kiln.requests"):
        RequestLog(level, "text", engine.tokenizer, cut=50).finished(req)
        RequestLog(level, "json", engine.tokenizer, cut=50).finished(req)
    text, as_json = (r.getMessage() for r in caplog.records)
    assert text.startswith(f"Finish: rid={req.rid!r}, prompt_tokens=197, completion_tokens=2")
    fields = json.loads(as_json)
    assert fields["rid"] == req.rid and fields["prompt_tokens"] == 197
    assert ("sampling_params" in fields) == ("sampling_params=" in text) == (level >= 1)
    assert ("input" in fields) == ("input=" in text) == (level >= 2)
    if level == 2:
        whole = engine.tokenizer.decode(prompt)
        assert fields["input"] == whole[:50] + "..." and len(whole) > 50


def test_texts_are_decoded_off_the_callers_thread(artefact, caplog) -> None:
    """The server logs from its event loop: with workers, the decode of a long prompt and
    the line itself happen on a worker, and finished() returns at once."""
    engine = Engine(artefact("llama"), max_total_tokens=1024)
    req = engine.make_request(list(range(3, 240)), SamplingParams(max_new_tokens=2, temperature=0))
    engine._run([req])
    workers = ThreadPoolExecutor(1, thread_name_prefix="log-test")
    with caplog.at_level(logging.INFO, logger="kiln.requests"):
        RequestLog(3, "json", engine.tokenizer, workers=workers).finished(req)
        RequestLog(1, "json", engine.tokenizer, workers=workers).finished(req)
        workers.shutdown(wait=True)
    by_level = {("input" in json.loads(r.getMessage())): r for r in caplog.records}
    whole = by_level[True]
    assert json.loads(whole.getMessage())["input"] == engine.tokenizer.decode(req.prompt_ids)
    assert whole.threadName.startswith("log-test")
    assert by_level[False].threadName == threading.current_thread().name  # nothing to decode


def test_a_crash_dump_keeps_five_minutes_of_ended_requests_and_those_in_flight(
    artefact, tmp_path, monkeypatch
) -> None:
    """--crash-dump-folder in-process: what ended inside the window (and under the cap) and
    every unfinished request, with their ids; the API keys left out; one dump."""
    engine = Engine(artefact("llama"), max_total_tokens=1024)
    reqs = [
        engine.make_request([3, 4, 5 + i], SamplingParams(max_new_tokens=2, temperature=0))
        for i in range(5)
    ]
    engine._run(reqs[:4])
    monkeypatch.setattr(request_log, "CRASH_DUMP_MAX_ENDED", 2)
    dump = CrashDump(str(tmp_path / "dumps"), {"api_key": "sk-secret", "port": 30000})
    clock = [1000.0]
    monkeypatch.setattr(request_log.time, "time", lambda: clock[0])
    dump.finished(reqs[0])
    clock[0] += request_log.CRASH_DUMP_WINDOW_S + 1
    dump.finished(reqs[1])  # reqs[0] ended more than 5 minutes before: gone (not the cap)
    assert [r["rid"] for _, r in dump._ended] == [reqs[1].rid]
    dump.finished(reqs[2])
    dump.finished(reqs[3])  # past the cap of 2: the oldest, reqs[1], goes
    path = dump.dump("a rank is gone", [reqs[4]])
    assert path is not None and path.parent.parent == tmp_path / "dumps"
    assert path.name.startswith("crash_dump_") and path.suffix == ".json"
    assert path.stat().st_mode & 0o777 == 0o600
    record = json.loads(path.read_text())
    assert record["reason"] == "a rank is gone"
    assert record["server_args"] == {"port": 30000}
    got = {r["rid"]: r for r in record["requests"]}
    assert list(got) == [reqs[2].rid, reqs[3].rid, reqs[4].rid]
    assert got[reqs[2].rid]["input_ids"] == [3, 4, 7] and got[reqs[2].rid]["finished"]
    assert got[reqs[2].rid]["output_ids"] == reqs[2].output_ids
    assert got[reqs[2].rid]["sampling_params"]["max_new_tokens"] == 2
    assert got[reqs[4].rid]["finished"] is False and got[reqs[4].rid]["output_ids"] == []
    assert dump.dump("again", []) is None  # one dump a server


def test_kiln_replay_sends_a_dump_again(artefact, launch, tmp_path) -> None:
    """`kiln replay`: a dump's requests through a live server give what they gave (greedy),
    in the dump's order; the CLI prints a line each and exits 0; a file that is no dump is
    one line."""
    engine = Engine(artefact("llama"), max_total_tokens=1024)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    reqs = [engine.make_request([3, 4, 5 + i], greedy) for i in range(3)]
    engine._run(reqs)
    dump = CrashDump(str(tmp_path / "dumps"), {})
    for req in reqs:
        dump.finished(req)
    path = dump.dump("test", [])
    assert path is not None
    server = launch(artefact("llama"), "--api-key", API_KEY)
    answers = replay.replay(replay.load(path), server.url, API_KEY)
    assert [a.rid for a in answers] == [r.rid for r in reqs]
    assert [a.body["output_ids"] for a in answers] == [r.output_ids for r in reqs]
    damaged = replay.load(path)
    damaged[1]["sampling_params"]["logit_bias"] = 5  # not (token, bias) pairs
    answers = replay.replay(damaged, server.url, API_KEY)
    assert [a.status for a in answers] == [200, 0, 200]  # reported, not dropped
    assert "the dump's entry cannot be sent" in answers[1].body["error"]
    cli = [sys.executable, "-m", "kiln", "replay", str(path), "--url", server.url]
    done = subprocess.run([*cli, "--api-key", API_KEY], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "replayed 3 requests: 3 answered 200, 0 not"
    assert lines[0].startswith(f"{reqs[0].rid}: 200 prompt_tokens=3 completion_tokens=6")
    refused = subprocess.run(cli, capture_output=True, text=True)  # no API key: 401s
    assert refused.returncode == 1 and refused.stdout.splitlines()[0].startswith(
        f"{reqs[0].rid}: 401"
    )
    not_a_dump = [*cli[:4], str(tmp_path), "--url", server.url]
    bad = subprocess.run(not_a_dump, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith(f"kiln replay: error: {tmp_path}: not a")


def test_configure_logging_turns_request_logging_on_and_off(artefact, launch) -> None:
    """SGLang's /configure_logging, with the admin key only: on at level 3, a request is
    logged whole; off again, the next is not; SGLang's dump folders are refused."""
    from serve_helpers import ADMIN_KEY

    server = launch(artefact("llama"), "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                    "--skip-server-warmup")  # fmt: skip
    on = {"log_requests": True, "log_requests_level": 3}
    assert server.post("/configure_logging", json=on).status_code == 401  # the shared key
    assert server.post("/configure_logging", json=on, key=ADMIN_KEY).json() == on
    body = {"model": "default", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
    server.post("/v1/completions", json={**body, "rid": "logged"})
    off = server.post("/configure_logging", json={"log_requests": False}, key=ADMIN_KEY)
    assert off.json() == {"log_requests": False, "log_requests_level": 3}
    server.post("/v1/completions", json={**body, "rid": "quiet"})
    dump = server.post("/configure_logging", json={"dump_requests_folder": "/tmp/x"}, key=ADMIN_KEY)
    assert dump.status_code == 400 and "dump_requests_folder" in dump.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while "rid='logged'" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log.read_text()
    [line] = [ln for ln in log.splitlines() if "rid='logged'" in ln]
    assert "Hello there" in line and "input=" in line  # level 3: the texts
    assert "rid='quiet'" not in log
