"""SGLang's sessions (/open_session, /close_session, /generate's session_params) at a real
server; the oracle is the same server asked for the whole prompt a session request stands
for, without the session."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_helpers import ADMIN_KEY

from kiln.runtime.request import Request, Status
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.sessions import SESSION_TOKENS, SessionStore
from kiln.serve.streams import ApiError

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(artefact, launch):
    return launch(
        artefact("llama"),
        "--admin-api-key",
        ADMIN_KEY,
        "--max-total-tokens",
        "4096",
        "--skip-server-warmup",
    )


@pytest.fixture(scope="module")
def bos(artefact) -> int:
    manifest = json.loads((artefact("llama") / "manifest.json").read_text())
    return int(manifest["runtime"]["bos_token_id"])


def _open(server, **body) -> str:
    r = server.post("/open_session", key=None, json={"capacity_of_str_len": 1000, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _gen(server, ids: list[int], session: dict | None = None, **kw) -> dict:
    body = {"input_ids": ids, "sampling_params": {**GREEDY, **kw.pop("sp", {})}, **kw}
    if session is not None:
        body["session_params"] = session
    r = server.post("/generate", key=None, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _error(server, body: dict, status: int) -> str:
    r = server.post("/generate", key=None, json=body)
    assert r.status_code == status, r.text
    return r.json()["message"]


def test_a_continuation_is_the_whole_conversation(server) -> None:
    """Each turn's prompt is the previous turn's prompt and output then the new input: the
    answer equals the same server's on that whole prompt, its prompt tokens counted so, and
    the earlier turns' K/V found in the prefix cache."""
    sid = _open(server)
    assert len(sid) == 32 and int(sid, 16) >= 0  # a fresh random id, as a JSON string
    first = _gen(server, [5, 6, 7, 8], {"id": sid})
    history = [5, 6, 7, 8] + first["output_ids"]
    rid = first["meta_info"]["id"]
    for new in ([9, 10], [11, 12, 13]):
        turn = _gen(server, new, {"id": sid, "rid": rid})
        history += new
        alone = _gen(server, history)
        assert turn["output_ids"] == alone["output_ids"]
        assert turn["meta_info"]["prompt_tokens"] == len(history)
        assert turn["meta_info"]["cached_tokens"] >= len(history) - len(new) - 16  # a page
        history += turn["output_ids"]
        rid = turn["meta_info"]["id"]


def test_offset_drop_previous_output_and_the_bos_token(server, bos) -> None:
    sid = _open(server, session_id="cut-" + "x" * 20)
    first = _gen(server, [5, 6, 7, 8, 9], {"id": sid}, rid="cut-first")
    out = first["output_ids"]
    cases = [
        ({"offset": 3}, [20], [5, 6, 7, 20]),
        ({"offset": -2}, [21], [*[5, 6, 7, 8, 9, *out][:-2], 21]),
        ({"drop_previous_output": True}, [22], [5, 6, 7, 8, 9, 22]),
        ({"drop_previous_output": True, "offset": 2}, [23], [5, 6, 23]),
        ({}, [bos, 24], [5, 6, 7, 8, 9, *out, 24]),  # an appended turn's BOS dropped
    ]
    for i, (params, new, whole) in enumerate(cases):
        turn = _gen(server, new, {"id": sid, "rid": "cut-first", **params}, rid=f"cut-{i}")
        assert turn["meta_info"]["prompt_tokens"] == len(whole), params
        assert turn["output_ids"] == _gen(server, whole)["output_ids"], params
    # the first turn of a session keeps its BOS token
    assert _gen(server, [bos, 5], {"id": sid})["meta_info"]["prompt_tokens"] == 2


def test_replace_branches_and_forgets_the_later_requests(server) -> None:
    sid = _open(server)
    a = _gen(server, [5, 6], {"id": sid}, rid="rep-a")
    _gen(server, [7], {"id": sid, "rid": "rep-a"}, rid="rep-b")
    _gen(server, [8], {"id": sid, "rid": "rep-b"}, rid="rep-c")
    # replace at a: b and c are forgotten, the new branch continues a
    branch = _gen(server, [9], {"id": sid, "rid": "rep-a", "replace": True}, rid="rep-d")
    whole = [5, 6, *a["output_ids"], 9]
    assert branch["output_ids"] == _gen(server, whole)["output_ids"]
    for gone in ("rep-b", "rep-c"):
        body = {"input_ids": [3], "session_params": {"id": sid, "rid": gone}}
        assert f"session_params.rid '{gone}' is not a request of this session" in _error(
            server, body, 400
        )
    _gen(server, [4], {"id": sid, "rid": "rep-d"}, rid="rep-e")  # the branch goes on
    # replace without a rid empties the session: a fresh start
    fresh = _gen(server, [5, 6], {"id": sid, "replace": True}, rid="rep-f")
    assert fresh["output_ids"] == a["output_ids"]
    for gone in ("rep-a", "rep-d", "rep-e"):
        body = {"input_ids": [3], "session_params": {"id": sid, "rid": gone}}
        _error(server, body, 400)
    # a rid already in the session is refused, not overwritten
    body = {"input_ids": [3], "rid": "rep-f", "session_params": {"id": sid}}
    assert "already a request of session" in _error(server, body, 400)


def test_an_unfinished_request_is_continued_only_by_replacing_it(server) -> None:
    """Appending to a request that has not finished is a 400; replacing it stops it
    (finish reason abort) and the new request starts from its tokens so far (none: it
    waits behind /pause_generation)."""
    sid = _open(server)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            r = await c.post("/pause_generation", json={"mode": "in_place"}, headers=admin)
            assert r.status_code == 200, r.text
            body = {"input_ids": [5], "rid": "run-a", "sampling_params": GREEDY}
            first = asyncio.ensure_future(
                c.post("/generate", json={**body, "session_params": {"id": sid}})
            )
            for _ in range(200):  # until it waits in the engine
                await asyncio.sleep(0.05)
                if (await c.get("/get_load")).json()[0]["num_waiting_reqs"]:
                    break
            body = {"input_ids": [6], "session_params": {"id": sid, "rid": "run-a"}}
            r = await c.post("/generate", json=body)
            assert r.status_code == 400 and "has not finished" in r.json()["message"]
            body = {**body, "sampling_params": GREEDY}
            body["session_params"] = {"id": sid, "rid": "run-a", "replace": True}
            second = asyncio.ensure_future(c.post("/generate", json=body))
            stopped = (await first).json()
            assert stopped["meta_info"]["finish_reason"]["type"] == "abort"
            assert "replaced" in stopped["meta_info"]["finish_reason"]["message"]
            assert (await c.post("/continue_generation", headers=admin)).status_code == 200
            r = await second
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == _gen(server, [5, 6])["output_ids"]

    asyncio.run(run())


def test_open_and_close_errors(server) -> None:
    sid = _open(server, session_id="twice")
    r = server.post("/open_session", key=None, json={"capacity_of_str_len": 1, "session_id": sid})
    assert r.status_code == 400 and "already open" in r.json()["message"]
    assert server.post("/close_session", key=None, json={"session_id": sid}).status_code == 200
    r = server.post("/close_session", key=None, json={"session_id": sid})
    assert r.status_code == 404 and "not open" in r.json()["message"]
    body = {"input_ids": [3], "session_params": {"id": sid}}
    assert "session 'twice' is not open" in _error(server, body, 404)
    r = server.post("/open_session", key=None, json={"session_id": "no-capacity"})
    assert r.status_code == 400 and "capacity_of_str_len" in r.text
    live = _open(server)
    for extra, why in [
        ({"input_ids": [[3], [4]]}, "not a batch"),
        ({"input_ids": [3], "sampling_params": {"n": 2}}, "n must be 1"),
        ({"input_ids": [3], "session_params": {"id": live, "rid": "nope"}}, "'nope' is not"),
    ]:
        body = {"session_params": {"id": live}, **extra}
        assert why in _error(server, body, 400)
    # session_params without an id is an ordinary request (SGLang's rule)
    plain = server.post("/generate", key=None, json={"input_ids": [3], "session_params": {}})
    assert plain.status_code == 200, plain.text
    assert server.get("/health").status_code == 200


def test_streamed_turns_are_kept_too(server) -> None:
    sid = _open(server)
    body = {
        "input_ids": [5, 6],
        "rid": "streamed",
        "stream": True,
        "sampling_params": GREEDY,
        "session_params": {"id": sid},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    out = json.loads(events[-2])["output_ids"]
    turn = _gen(server, [7], {"id": sid, "rid": "streamed"})
    assert turn["output_ids"] == _gen(server, [5, 6, *out, 7])["output_ids"]


def _request(rid: str, prompt: list[int], max_new_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens))


def test_the_store_closes_idle_sessions_first_and_refuses_what_cannot_fit() -> None:
    """The least recently used sessions with nothing running are closed to make room, a
    running one never; a request that would not fit even then is a 400 and closes none."""
    store = SessionStore(budget=3 * SESSION_TOKENS + 300)
    a, b, c = (store.open(None, 0) for _ in range(3))
    store.begin(a, {}, "a1", list(range(100)), 100, None)  # 200 tokens charged
    store.attach(a, "a1", _request("a1", list(range(100)), 100))  # running
    store.begin(b, {}, "b1", list(range(50)), 50, None)  # 100, finished below
    store.attach(b, "b1", _request("b1", list(range(50)), 50))
    assert store.used == 3 * SESSION_TOKENS + 300
    with pytest.raises(ApiError, match="does not fit"):  # 500 more: even closing b and c
        store.begin(a, {}, "a2", list(range(250)), 250, None)
    assert len(store) == 3 and store.used == 3 * SESSION_TOKENS + 300
    b_req = store.get(b).turns["b1"].request
    assert b_req is not None
    b_req.status, b_req.output_ids = Status.FINISHED, [7] * 20  # b1 ends with 20 tokens
    # 60 more: least recently used idle first: c (the order is c, a, b now), then enough
    store.begin(a, {}, "a2", list(range(30)), 30, None)
    assert len(store) == 2 and store.used == 2 * SESSION_TOKENS + 200 + 70 + 60
    with pytest.raises(ApiError, match="not open"):
        store.get(c)
    # replace a running request: it is to be stopped, its later requests forgotten
    prompt, stop = store.begin(a, {"rid": "a1", "replace": True}, "a3", [9], 10, None)
    assert prompt == [*range(100), 9] and [r.rid for r in stop] == ["a1"]
    assert store.get(a).turns["a1"].children == ["a3"]
