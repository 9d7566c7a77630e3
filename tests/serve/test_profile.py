"""/start_profile and /stop_profile (SGLang's): a Chrome trace of the engine's steps and
of each native call inside them, written as a new gzipped JSON file; admin key only."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
from serve_helpers import ADMIN_KEY, API_KEY

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(artefact, launch):
    return launch(artefact("llama"), "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)


def _trace(folder: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob("*-TP-0.trace.json.gz"))
        if found:
            try:
                return json.loads(gzip.decompress(found[-1].read_bytes()))
            except (OSError, EOFError, ValueError):  # still being written
                pass
        time.sleep(0.05)
    raise AssertionError(f"no trace in {folder}")


def _generate(server) -> None:
    r = server.post("/generate", json={"input_ids": [4, 5, 9], "sampling_params": GREEDY})
    assert r.status_code == 200, r.text


def test_a_profile_traces_steps_and_their_calls(server, tmp_path) -> None:
    first = tmp_path / "first"
    first.mkdir()
    r = server.post("/start_profile", key=API_KEY, json={"output_dir": str(first)})
    assert r.status_code == 401  # it writes files on the server: the admin key's
    body = {"output_dir": str(first), "num_steps": 4, "profile_prefix": "run"}
    r = server.post("/start_profile", key=ADMIN_KEY, json=body)
    assert r.status_code == 200 and r.text == "Start profiling.\n", r.text
    again = server.post("/start_profile", key=ADMIN_KEY, json=body)
    assert again.status_code == 400 and "already" in again.json()["message"]
    _generate(server)  # a prefill step (nothing cached), then decode steps: four kept
    trace = _trace(first)
    [name] = [p.name for p in first.iterdir()]
    assert name.startswith("run-") and name.endswith("-TP-0.trace.json.gz")
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["tid"] == 0]
    assert [e["name"] for e in steps] == ["prefill step"] + ["decode step"] * 3
    assert steps[0]["args"] == {"requests": 1, "rows": 3}
    calls = [e for e in events if e["tid"] == 1]
    assert len(calls) % 4 == 0 and len(calls) >= 4 * 10  # every step ran natively
    assert any(e["name"].endswith("_linear 96 -> 384") for e in calls)  # op, in -> out
    for step in steps:  # each call inside its step
        inside = [c for c in calls if step["ts"] <= c["ts"] <= step["ts"] + step["dur"]]
        assert len(inside) == len(calls) // 4
    # no num_steps: until /stop_profile; a missing folder is refused
    r = server.post("/start_profile", key=ADMIN_KEY, json={"output_dir": str(tmp_path / "no")})
    assert r.status_code == 400 and "is not a folder" in r.json()["message"]
    second = tmp_path / "second"
    second.mkdir()
    assert server.post("/start_profile", key=ADMIN_KEY, json={"output_dir": str(second)}).is_success
    _generate(server)
    assert server.post("/stop_profile", key=ADMIN_KEY).text.startswith("Stop profiling.")
    steps = [e for e in _trace(second)["traceEvents"] if e.get("tid") == 0 and e["ph"] == "X"]
    assert len(steps) == 10  # the whole request: its prefill and nine decode steps
    r = server.post("/stop_profile", key=ADMIN_KEY)
    assert r.status_code == 400 and "no profile" in r.json()["message"]
