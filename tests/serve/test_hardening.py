"""A real server against hostile and careless clients: no request can read, stop or slow
another's; bad input is a 4xx naming the field; nothing is silently ignored."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from serve_helpers import API_KEY, generated_tokens, wait_until_running

from kiln import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(artefact, launch):
    # A long context, so that long generations (dropped clients, rids) are possible.
    return launch(
        artefact("llama", max_position_embeddings=8192),
        "--api-key",
        API_KEY,
        "--enable-metrics",
        "--max-total-tokens",
        "16384",
    )


@pytest.fixture(scope="module")
def engine(artefact) -> Engine:
    return Engine(artefact("llama", max_position_embeddings=8192), max_total_tokens=4096)


def sse_events(lines: list[str]) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


async def stream_generate(c: httpx.AsyncClient, body: dict) -> list[dict]:
    async with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return sse_events([line async for line in r.aiter_lines()])


# -- item 3: request ids -----------------------------------------------------------------------
def test_a_rid_in_flight_cannot_be_taken_over(server, engine) -> None:
    # Long enough to still run when the thief comes, on any machine's speed.
    params = {**GREEDY, "max_new_tokens": 1500}
    expected = engine.generate("Hello", params)["output_ids"]

    async def run() -> tuple[list[dict], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            first = asyncio.ensure_future(
                stream_generate(c, {"text": "Hello", "sampling_params": params, "rid": "mine"})
            )
            await wait_until_running(c, 1)
            thief = await c.post(
                "/generate", json={"text": "Hi", "sampling_params": GREEDY, "rid": "mine"}
            )
            return await first, thief

    events, thief = asyncio.run(run())
    assert thief.status_code == 400 and "rid 'mine' is already in use" in thief.json()["message"]
    assert events[-1]["output_ids"] == expected and events[-1]["meta_info"]["id"] == "mine"
    # Once it finished, the id is free again.
    again = server.post("/generate", json={"text": "Hi", "sampling_params": GREEDY, "rid": "mine"})
    assert again.status_code == 200


def test_server_request_ids_are_not_guessable(server) -> None:
    ids = [
        server.post("/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY}).json()[
            "meta_info"
        ]["id"]
        for _ in range(2)
    ]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]


def test_rids_fan_out_and_must_be_distinct(server) -> None:
    r = server.post(
        "/generate",
        json={"input_ids": [[1, 2], [3, 4]], "sampling_params": GREEDY, "rid": ["a", "a"]},
    )
    assert r.status_code == 400 and "rid 'a' is already in use" in r.json()["message"]
    r = server.post(
        "/generate",
        json={"input_ids": [1, 2], "sampling_params": {**GREEDY, "n": 2}, "rid": "pair"},
    )
    assert [x["meta_info"]["id"] for x in r.json()] == ["pair_0", "pair_1"]


# -- item 4: one bad request never touches the others ------------------------------------------
def test_bad_requests_leave_innocent_streams_alone(server, engine) -> None:
    # Long enough that the first stream is still running when the eighth starts.
    params = {**GREEDY, "max_new_tokens": 200}
    prompts = [f"Request {i}" for i in range(8)]
    expected = [engine.generate(p, params)["output_ids"] for p in prompts]
    bad = [
        ("/v1/completions", {"prompt": "hi", "temperature": 1e-45, "max_tokens": 4}, 200),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 2.5}}, 400),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": [[5.5, 1]]}}, 400),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, 400),
    ]

    async def run() -> tuple[list[list[dict]], list[int]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            streams = [
                asyncio.ensure_future(stream_generate(c, {"text": p, "sampling_params": params}))
                for p in prompts
            ]
            await wait_until_running(c, 8)
            codes = [(await c.post(path, json=body)).status_code for path, body, _ in bad]
            return await asyncio.gather(*streams), codes

    results, codes = asyncio.run(run())
    assert codes == [want for _, _, want in bad]
    for events, want in zip(results, expected, strict=True):
        assert events[-1]["output_ids"] == want
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


# -- item 5: big and fan-out requests do not stall the server -----------------------------------
def test_health_stays_fast_while_a_huge_prompt_is_tokenized(server) -> None:
    prompt = "The kiln turns clay into stone. " * 150_000  # 4.8 MB of text

    async def run() -> tuple[httpx.Response, list[float]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            big = asyncio.ensure_future(
                c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            )
            waits = []
            while not big.done():
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                waits.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
            return await big, waits

    big, waits = asyncio.run(run())
    assert big.status_code == 400 and "more than the context length" in big.json()["message"]
    assert len(waits) >= 5, "the prompt was handled before /health could be measured"
    assert max(waits) < 0.5, max(waits)


def test_clearing_a_storage_tier_the_server_lacks_is_a_400(server) -> None:
    r = server.post("/clear_hicache_storage_backend")
    assert r.status_code == 400 and "--hicache-storage-backend file" in r.json()["message"]


def test_body_size_and_fan_out_are_bounded(server) -> None:
    r = server.post("/v1/completions", json={"prompt": "x" * (9 * 1024 * 1024)})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["message"]
    t0 = time.perf_counter()
    r = server.post("/v1/completions", json={"prompt": "x", "n": 100_000})
    assert r.status_code == 400 and "n must be in [1, 128]" in r.json()["message"]
    r = server.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 21})
    assert r.status_code == 400 and "best_of must be in [n, 20]" in r.json()["message"]
    r = server.post("/generate", json={"input_ids": [[1]] * 600, "sampling_params": {"n": 2}})
    assert r.status_code == 400 and "fans out to 1200 generations" in r.json()["message"]
    assert time.perf_counter() - t0 < 5


# -- item 6: a client that leaves stops its generation -----------------------------------------


def test_dropped_non_streaming_clients_stop_generating(server) -> None:
    before = generated_tokens(server)
    body = {"prompt": "Hello", "max_tokens": 8000, "ignore_eos": True}

    async def drop_all() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=0.5) as c:

            async def one() -> None:
                with pytest.raises(httpx.TimeoutException):
                    await c.post("/v1/completions", json=body)

            await asyncio.gather(*(one() for _ in range(10)))

    asyncio.run(drop_all())
    at_drop = generated_tokens(server) - before  # what 0.5 s of generation is on this machine
    deadline = time.time() + 5
    while server.get("/get_server_info").json()["num_running_reqs"] and time.time() < deadline:
        time.sleep(0.05)
    assert server.get("/get_server_info").json()["num_running_reqs"] == 0
    time.sleep(0.3)
    spent = generated_tokens(server) - before
    # None ran to its end, and generation stopped within about a second of the drop, however
    # fast this machine is.
    assert spent < 10 * 8000 / 2, spent
    assert spent - at_drop < 2 * at_drop + 200, (at_drop, spent)


# -- item 7: bad input is a 400 naming the field --------------------------------------------
SURROGATE = '"a\\ud800b"'  # JSON text: a lone surrogate, valid JSON, not valid Unicode


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", '{"prompt": %s}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}', "content"),
        ("/generate", '{"text": %s}', "text"),
        ("/generate", '{"text": "x", "sampling_params": {"stop": [%s]}}', "stop"),
    ],
)
def test_lone_surrogates_are_a_400(server, path, body, field) -> None:
    r = server.post(
        path, content=(body % SURROGATE).encode(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["message"] and field in r.json()["message"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": "hot"}, "temperature: expected a finite number"),
        ({"max_new_tokens": "5"}, "max_new_tokens: expected an integer"),
        ({"n": None}, "n: expected a value, got null"),
        ({"stop": 5}, "stop: expected a string or a list of strings"),
        ({"sampling_seed": 1.5}, "sampling_seed: expected an integer"),
        ({"logit_bias": {"5": None}}, "logit_bias['5']: expected a finite number"),
        ({"top_k": 2.5}, "top_k: expected an integer"),
        ("fast", "sampling_params: expected an object or a list of objects"),
    ],
)
def test_generate_sampling_params_of_the_wrong_type(server, params, message) -> None:
    r = server.post("/generate", json={"text": "x", "sampling_params": params})
    assert r.status_code == 400 and message in r.json()["message"], r.text


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [[False]]}, "input_ids: expected a list of token ids"),
        ({"input_ids": [1, "2"]}, "input_ids: expected a list of token ids"),
        ({"input_ids": []}, "input_ids: expected a list of token ids"),
        ({"text": "x", "stream": "yes"}, "stream: Input should be a valid boolean"),
    ],
)
def test_generate_bodies_of_the_wrong_type(server, body, message) -> None:
    r = server.post("/generate", json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text


def test_openai_fields_are_strictly_typed(server) -> None:
    for body, message in (
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
        ({"prompt": "x", "temperature": True}, "temperature: Input should be a valid number"),
        ({"prompt": [1, True]}, "prompt: expected a string"),
    ):
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 400 and message in r.json()["message"], r.text
    r = server.post(
        "/v1/completions",
        content=b'{"prompt": "x", "temperature": NaN}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "temperature" in r.json()["message"]


# -- item 8: nothing silently ignored ----------------------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path, extra, named",
    [
        ("/v1/completions", {"stop_regex": "a+"}, "stop_regex: not supported"),
        ("/v1/completions", {"lora_path": "x"}, "lora_path 'x': this server runs without --ena"),
        ("/v1/completions", {"temprature": 0.5}, "temprature: unknown field"),
        ("/v1/chat/completions", {"stop_regex": "a+"}, "stop_regex: not supported"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions: not supported"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort: not supported"),
        ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate: unknown field"),
        ("/generate", {"sampling_params": {"stop_regex": "a+"}}, "stop_regex: not supported"),
        ("/generate", {"image_data": "x.png"}, "image_data: not supported"),
        ("/generate", {"frobnicate": 1}, "frobnicate: unknown field"),
    ],
)
def test_unimplemented_and_unknown_fields_are_refused(server, path, extra, named) -> None:
    base = CHAT if "chat" in path else {"prompt": "x"} if "v1" in path else {"text": "x"}
    r = server.post(path, json={**base, **extra})
    assert r.status_code == 400 and named in r.json()["message"], r.text


def test_defaults_and_documented_no_ops_are_accepted(server) -> None:
    ok = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "regex": None, "user": "u1"}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "return_hidden_states": False}),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "none", "parallel_tool_calls": True}),
        ("/v1/chat/completions", {**CHAT, "metadata": {"k": "v"}, "service_tier": "auto"}),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}, "log_metrics": True}),
    ]
    for path, body in ok:
        r = server.post(path, json=body)
        assert r.status_code == 200, (path, r.text)


# -- item 11: browsers cannot make the server work for them ---------------------------------
def test_cross_site_and_form_posts_are_refused(artefact, launch) -> None:
    open_server = launch(artefact("llama"), "--max-total-tokens", "256", "--skip-server-warmup")
    r = httpx.post(
        open_server.url + "/flush_cache", content=b"", headers={"Content-Type": "text/plain"}
    )
    assert r.status_code == 415 and "send JSON" in r.json()["message"]
    r = httpx.post(open_server.url + "/flush_cache", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["message"]
    r = httpx.post(
        open_server.url + "/generate",
        content=b'{"text": "x"}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 415
    same = open_server.url.removeprefix("http://")
    r = httpx.post(open_server.url + "/flush_cache", headers={"Origin": f"http://{same}"})
    assert r.status_code == 200
    assert httpx.post(open_server.url + "/flush_cache").status_code == 200  # curl -X POST
    # With no admin key, nobody may stop the requests of others.
    r = httpx.post(open_server.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]


# -- second round, item 10: DNS rebinding ------------------------------------------------------
def test_a_rebound_page_cannot_reach_a_loopback_server(artefact, launch) -> None:
    """A page on evil.com rebound to 127.0.0.1 sends Host: evil.com and a matching Origin:
    the Origin check alone let it through (a 200 from /generate). Loopback names and
    --allowed-hosts are answered; any other Host is a 403, on every path."""
    server = launch(
        artefact("llama"),
        "--max-total-tokens",
        "256",
        "--skip-server-warmup",
        "--allowed-hosts",
        "llm.example.com",
    )
    port = server.url.rsplit(":", 1)[1]
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for host in (f"evil.com:{port}", "evil.com", f"127.0.0.1.evil.com:{port}", "localhost.evil"):
        r = httpx.post(
            server.url + "/generate",
            json=body,
            headers={"Host": host, "Origin": f"http://{host}"},
        )
        assert r.status_code == 403 and "not a name of this server" in r.json()["message"], host
        r = httpx.get(server.url + "/get_model_info", headers={"Host": host})
        assert r.status_code == 403, host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "llm.example.com"):
        r = httpx.post(server.url + "/generate", json=body, headers={"Host": host})
        assert r.status_code == 200, (host, r.text)


def test_host_names_are_read_as_a_browser_sends_them() -> None:
    from kiln.serve.middleware import FrontDoor, host_name, is_loopback

    assert [host_name(h) for h in ("a.B:80", "[::1]:8000", "::1", "x")] == [
        "a.b",
        "::1",
        "::1",
        "x",
    ]
    assert all(map(is_loopback, ("localhost", "api.localhost", "127.0.0.9", "::1")))
    assert not any(map(is_loopback, ("evil.com", "10.0.0.1", "localhost.evil")))

    def names(host: str, allowed: tuple[str, ...] = ()) -> set[str] | None:
        return FrontDoor(None, None, None, 1, host, allowed).host_names  # type: ignore[arg-type]

    assert names("0.0.0.0") is None  # bound to every address, no list: any Host
    assert names("0.0.0.0", ("a.example",)) == {"a.example", "0.0.0.0"}
    assert names("127.0.0.1") == {"127.0.0.1"}
