"""The server through the official openai client, against a real `kiln serve` process."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import (
    ADMIN_KEY,
    API_KEY,
    metric,
    stop_server,
    stream_completions,
    wait_until_running,
)

from kiln import Engine
from kiln.runtime import numa

MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}


# Every test on the server runs against a one-process artefact and a tensor-parallel one
# (rank 0 serves, rank 1 its own process): the answers must not depend on it. Each process
# is bound to NUMA node 0 (every machine has one), which must not change them either; the
# tensor-parallel one reads its weights into memory (--weight-loader-disable-mmap).
@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(artefact, launch, request):
    return launch(
        artefact("llama", compile_args={"tp_size": request.param}),
        "--numa-node",
        *["0"] * request.param,
        "--api-key",
        API_KEY,
        "--admin-api-key",
        ADMIN_KEY,
        "--enable-metrics",
        "--collect-tokens-histogram",
        "--generation-tokens-buckets",
        "custom",
        "5",
        "12",
        "50",
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "tiny",
        # the tensor-parallel server reads its weights into memory, rank 1 too
        *(["--weight-loader-disable-mmap"] if request.param == 2 else []),
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def engine(artefact) -> Engine:
    """The offline engine on the same artefact: the server must agree with it."""
    return Engine(artefact("llama"), max_total_tokens=4096)


def completion(client, prompt, **kw):
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}, **kw}
    return client.completions.create(model="tiny", prompt=prompt, **kw)


def test_models(client, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_each_process_is_bound_to_its_numa_node(server) -> None:
    """--numa-node 0 (0): the server's process and its tensor-parallel rank prefer node 0's
    memory (the kernel shows a process's policy in numa_maps) and run on its CPUs, with its
    cores shared between them when --threads is not given. The tp2 server's processes map
    no weights file (--weight-loader-disable-mmap), the tp1 server's does."""
    ranks = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True)
    pids = [server.process.pid, *map(int, ranks.stdout.split())]
    node0 = numa.nodes()[0]
    for pid in pids:
        first = Path(f"/proc/{pid}/numa_maps").read_text().split("\n", 1)[0]
        assert " prefer:0 " in first, (pid, first)
        assert os.sched_getaffinity(pid) <= node0
    # --weight-loader-disable-mmap (the tp2 server): no process maps its weights file
    mapped = [".safetensors" in Path(f"/proc/{pid}/maps").read_text() for pid in pids]
    assert mapped == [len(pids) == 1] * len(pids), mapped
    log = server.log.read_text()
    [whole] = numa.shares([0])
    share = whole if len(pids) == 1 else max(1, whole // 2)
    assert f"threads: {share} (NUMA node 0's cores)" in log


def test_greedy_completion_equals_the_engine(client, engine) -> None:
    for prompt in ("Hello", "The capital of France is", "One, two, three"):
        out = completion(client, prompt)
        expected = engine.generate(prompt, GREEDY)
        assert out.choices[0].text == expected["text"]
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
        assert out.usage.completion_tokens == MAX_TOKENS


def test_streaming_completion_matches_and_reports_usage(client, engine) -> None:
    chunks = list(completion(client, "Hello", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine.generate("Hello", GREEDY)["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_echo_and_batches(client, engine) -> None:
    out = completion(client, [1, 5, 9, 33])
    assert (
        out.choices[0].text
        == engine.generate(input_ids=[1, 5, 9, 33], sampling_params=GREEDY)["text"]
    )
    out = completion(client, "Hello", echo=True)
    assert out.choices[0].text.startswith("Hello")
    out = completion(client, ["Hello", "One, two"])
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[1].text == engine.generate("One, two", GREEDY)["text"]


def test_n_and_best_of(client) -> None:
    out = completion(client, "Hello", n=3, temperature=1.0, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 3 * MAX_TOKENS
    best = completion(client, "Hello", n=1, best_of=3, temperature=1.0, seed=5)
    assert len(best.choices) == 1


def test_stop_strings(client, engine) -> None:
    full = engine.generate("Hello", GREEDY)["text"]
    stop = full[4:7]
    for stream in (False, True):
        kw = {"stop": [stop], "stream": stream}
        if stream:
            chunks = list(completion(client, "Hello", **kw))
            text = "".join(c.choices[0].text for c in chunks)
            last = [c.choices[0] for c in chunks][-1]
        else:
            last = completion(client, "Hello", **kw).choices[0]
            text = last.text
        assert text == full[: full.index(stop)]
        assert last.finish_reason == "stop" and last.model_extra["matched_stop"] == stop


def test_logprobs(client) -> None:
    out = completion(client, "Hello", logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 for c in content)
    for c in content:  # the token's own bytes; a partial character's are not U+FFFD's
        if "\ufffd" in c.token:
            assert bytes(c.bytes) != "\ufffd".encode()
        else:
            assert bytes(c.bytes) == c.token.encode()


def test_chat_uses_the_template_and_streams(client, engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    expected = engine.generate(input_ids=ids, sampling_params=GREEDY)["text"]
    kw = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    out = client.chat.completions.create(**kw)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == len(ids) + MAX_TOKENS


def test_32_concurrent_streams_complete_with_correct_text(server, engine) -> None:
    prompts = [f"Request number {i}: hello" for i in range(32)]
    expected = [r["text"] for r in engine.generate(prompts, GREEDY)]
    assert stream_completions(server, prompts, MAX_TOKENS) == expected


def test_auth(server) -> None:
    anon = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()
    r = server.post("/generate", key=None, json={"text": "x"})
    assert r.status_code == 401 and r.json()["message"] == "invalid or missing API key"
    assert server.get("/health", key=None).status_code == 200
    assert server.get("/metrics", key=None).status_code == 200
    assert server.post("/flush_cache", key=API_KEY).status_code == 401  # admin path
    assert server.post("/flush_cache", key=ADMIN_KEY).status_code == 200


@pytest.mark.parametrize(
    "body, status, message",
    [
        (
            {"prompt": "x" * 2000, "max_tokens": 1},
            400,
            r"the prompt has \d+ tokens, more than the "
            r"context length of 256",
        ),
        (
            {"prompt": "Hello", "max_tokens": 300},
            400,
            r"plus max tokens \(300\) exceeds the context "
            "length of 256",
        ),
        ({"prompt": "", "max_tokens": 4}, 400, "the prompt is empty"),
        ({"prompt": [1, 99999], "max_tokens": 4}, 400, r"outside the vocabulary \[0, 384\)"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature must be >= 0"),
        ({"prompt": "x", "top_p": 0}, 400, r"top_p must be in \(0, 1\]"),
        ({"prompt": "x", "n": 0}, 400, r"n must be in \[1, 128\], got 0"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"max_tokens": 3}, 400, "prompt: Field required"),
        ({"prompt": "x", "best_of": 1, "n": 2}, 400, r"best_of must be in \[n, 20\], got 1"),
    ],
)
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(
    server, body, status, message
) -> None:
    r = server.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == status
    payload = r.json()
    assert payload["object"] == "error" and payload["code"] == status
    assert __import__("re").search(message, payload["message"]), payload["message"]
    assert (
        server.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}
        ).status_code
        == 200
    )


def test_malformed_json_is_a_400(server) -> None:
    r = server.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["type"] == "BadRequestError"


def test_disconnect_mid_stream_frees_memory(server) -> None:
    def idle(info: dict) -> bool:  # no request holds a page (the prefix cache may)
        return info["kv_pages_free"] + info["kv_pages_cached"] == info["kv_pages_total"]

    assert idle(server.get("/get_server_info").json())
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in first)
    # The client is gone; its request is aborted and its pages return to the pool.
    deadline = time.time() + 20
    while time.time() < deadline:
        info = server.get("/get_server_info").json()
        if info["num_running_reqs"] == 0 and idle(info):
            break
        time.sleep(0.1)
    assert idle(info), info
    assert info["num_running_reqs"] == 0 and info["api_key"] == "***"


def test_health_answers_while_the_engine_is_busy(server) -> None:
    async def run() -> list[float]:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as c:
            body = {
                "model": "tiny",
                "prompt": "Hello",
                "max_tokens": 240,
                "temperature": 0,
                "ignore_eos": True,
            }
            load = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(32)]
            busy_waits = []
            while not all(t.done() for t in load):
                # Timed only once the server runs requests: the first probes share this
                # client's loop with opening the load's 32 connections, which is not the
                # server's latency (a tp2 run on 2 cores once waited 0.56 s there).
                running = (await c.get("/get_server_info")).json()["num_running_reqs"] > 0
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                wait = time.perf_counter() - t0
                if running and (await c.get("/get_server_info")).json()["num_running_reqs"] > 0:
                    busy_waits.append(wait)
                await asyncio.sleep(0.05)
            assert all(r.status_code == 200 for r in await asyncio.gather(*load))
            return busy_waits

    waits = asyncio.run(run())
    assert len(waits) >= 3, "the load finished before /health could be measured under it"
    assert max(waits) < 0.5, waits


def test_native_generate(server, engine) -> None:
    expected = engine.generate("Hello", GREEDY)
    r = server.post("/generate", json={"text": "Hello", "sampling_params": GREEDY})
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == expected["text"] and out["output_ids"] == expected["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == MAX_TOKENS
    batch = server.post(
        "/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": GREEDY}
    ).json()
    assert len(batch) == 2 and all(len(b["output_ids"]) == MAX_TOKENS for b in batch)
    events = []
    with httpx.stream(
        "POST",
        server.url + "/generate",
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"text": "Hello", "sampling_params": GREEDY, "stream": True},
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["text"] == expected["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_reports_named_tokens_logprobs(server, engine) -> None:
    """/generate's token_ids_logprob (one list for every prompt, or one each) and
    return_text_in_logprobs give what the engine gives, in SGLang's (logprob, id, text)
    entries; a list count that does not match the prompts, or an id outside the
    vocabulary, is a 400."""
    prompt, ids = [1, 5, 9, 33], [7, 40, 2]
    kw = {"return_logprob": True, "logprob_start_len": 1, "token_ids_logprob": ids}
    want = engine.generate(
        input_ids=prompt, sampling_params=GREEDY, return_text_in_logprobs=True, **kw
    )["meta_info"]
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_text_in_logprobs": True}
    meta = server.post("/generate", json={**body, **kw}).json()["meta_info"]
    for field in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        got, exp = meta[field], want[field]  # JSON lists against the engine's tuples
        assert [e and [x[1:] for x in e] for e in got] == [
            e and [list(x[1:]) for x in e] for e in exp
        ]
        values = [x[0] for e in exp if e for x in e]
        assert [x[0] for e in got if e for x in e] == pytest.approx(values, abs=1e-5)
    assert meta["output_token_ids_logprobs"][0][0][2] == engine.tokenizer.decode([7])
    two = {**kw, "input_ids": [prompt, prompt[:2]], "sampling_params": GREEDY}
    outs = server.post("/generate", json={**two, "token_ids_logprob": [[3], [4, 5]]}).json()
    assert [[x[1] for x in o["meta_info"]["output_token_ids_logprobs"][0]] for o in outs] == [
        [3],
        [4, 5],
    ]
    assert outs[0]["meta_info"]["output_token_logprobs"][0][2] is None  # no text asked
    r = server.post("/generate", json={**two, "token_ids_logprob": [[3]]})
    assert r.status_code == 400 and "1 token_ids_logprob lists for 2 prompts" in r.text
    r = server.post("/generate", json={**body, **kw, "token_ids_logprob": [10**6]})
    assert r.status_code == 400 and "outside the vocabulary" in r.text


def test_score_gives_the_label_tokens_probabilities(server, engine) -> None:
    """SGLang's /v1/score: per item, each label token's probability right after query +
    item (the engine's logprob of it, exponentiated), or a softmax over the labels alone;
    token ids with item_first put the item first. Incomplete bodies are a 400."""
    labels = [7, 40, 2]

    def logprobs(ids: list[int]) -> list[float]:
        out = engine.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            token_ids_logprob=labels,
        )
        return [v for v, _, _ in out["meta_info"]["output_token_ids_logprobs"][0]]

    query, items = "Is the sky blue?", [" yes", " no"]
    r = server.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and out["model"] == "tiny"
    want = [[math.exp(v) for v in logprobs(engine.encode(query + i))] for i in items]
    assert len(out["scores"]) == 2
    for got, exp in zip(out["scores"], want, strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
    ids_body = {"query": [5, 6], "items": [[9, 10, 11]], "label_token_ids": labels}
    soft = server.post("/v1/score", json={**ids_body, "apply_softmax": True, "item_first": True})
    lps = logprobs([9, 10, 11, 5, 6])
    exps = [math.exp(v - max(lps)) for v in lps]
    assert soft.json()["scores"] == [pytest.approx([e / sum(exps) for e in exps], rel=1e-4)]
    assert sum(soft.json()["scores"][0]) == pytest.approx(1.0)
    assert soft.json()["usage"]["prompt_tokens"] == 5
    vocab = engine.art.spec.vocab_size
    for bad in (
        {"query": query, "items": items},
        {"query": query, "items": [], "label_token_ids": labels},
        {"query": query, "items": [[1, 2]], "label_token_ids": labels},
        {"query": query, "items": items, "label_token_ids": [vocab]},
        {"items": items, "label_token_ids": labels},
    ):
        r = server.post("/v1/score", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], bad


def test_abort_request_stops_the_named_request_only(server) -> None:
    """SGLang's /abort_request with the admin key: the stream with that rid ends with
    finish reason abort, the one beside it runs to its length; the shared API key is
    refused (one client must not stop another's request)."""
    new = 240

    async def run() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as http:

            async def stream(rid: str) -> dict:
                body = {
                    "text": "Hello",
                    "rid": rid,
                    "stream": True,
                    "sampling_params": {**GREEDY, "max_new_tokens": new},
                }
                last: dict = {}
                async with http.stream("POST", "/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = json.loads(line[6:])
                return last["meta_info"]

            tasks = [asyncio.create_task(stream(rid)) for rid in ("victim", "bystander")]
            await wait_until_running(http, 2)
            refused = await http.post("/abort_request", json={"rid": "victim"})
            assert refused.status_code == 401
            answer = await http.post(
                "/abort_request",
                json={"rid": "victim"},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )
            victim, bystander = await asyncio.gather(*tasks)
            return answer.json(), victim, bystander

    answer, victim, bystander = asyncio.run(run())
    assert answer == {"aborted": 1}
    assert victim["finish_reason"]["type"] == "abort" and victim["completion_tokens"] < new
    assert bystander["finish_reason"]["type"] == "length"
    assert bystander["completion_tokens"] == new
    admin = {"key": ADMIN_KEY}
    assert server.post("/abort_request", json={"rid": "gone"}, **admin).json() == {"aborted": 0}
    assert server.post("/abort_request", json={}, **admin).status_code == 400


def test_pause_and_continue_generation(server, engine) -> None:
    """SGLang's /pause_generation: in place and retracted, a paused stream gains no token
    and then ends as the engine's greedy text (retracted: prefilled again from what it
    had); a request that arrives while paused waits; abort ends the one in flight. The
    routes take the admin key only."""
    new = 160
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    expected = engine.generate("Hello", {**GREEDY, "max_new_tokens": new})["text"]

    async def run(http: httpx.AsyncClient, mode: str) -> tuple[dict, int, int, dict]:
        chunks: list[dict] = []

        async def stream() -> None:
            body = {"text": "Hello", "stream": True,
                    "sampling_params": {**GREEDY, "max_new_tokens": new}}  # fmt: skip
            async with http.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))

        task = asyncio.create_task(stream())
        await wait_until_running(http, 1)
        paused = await http.post("/pause_generation", json={"mode": mode}, headers=admin)
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        later = asyncio.create_task(
            http.post("/generate", json={"text": "One", "sampling_params": GREEDY})
        )
        await asyncio.sleep(0.2)
        held = len(chunks)
        await asyncio.sleep(0.8)
        seen = len(chunks)
        assert not later.done()  # it waits for the engine
        [load] = (await http.get("/get_load")).json()
        assert load["num_reqs"] == (1 if mode == "abort" else 2), mode
        # retracted: the stream waits again beside the later request, its pages given back
        assert load["num_waiting_reqs"] == (2 if mode == "retract" else 1), mode
        assert (await http.get("/health_generate")).status_code == 200
        resumed = await http.post("/continue_generation", headers=admin)
        assert resumed.json()["status"] == "ok"
        await task
        assert (await later).json()["meta_info"]["completion_tokens"] == MAX_TOKENS
        return chunks[-1], held, seen, chunks[-1]["meta_info"]

    async def all_modes() -> dict[str, tuple[dict, int, int, dict]]:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as http:
            refused = await http.post("/pause_generation", json={"mode": "in_place"})
            assert refused.status_code == 401
            bad = await http.post("/pause_generation", json={"mode": "later"}, headers=admin)
            assert bad.status_code == 400
            return {m: await run(http, m) for m in ("in_place", "retract", "abort")}

    got = asyncio.run(all_modes())
    for mode in ("in_place", "retract"):
        last, held, seen, meta = got[mode]
        assert held == seen and 0 < held < new, mode  # nothing while paused
        assert last["text"] == expected and meta["finish_reason"]["type"] == "length", mode
    _, held, _, meta = got["abort"]
    assert meta["finish_reason"]["message"] == "aborted by /pause_generation"
    assert meta["completion_tokens"] < new


def test_cache_salt_and_extra_key_keep_cached_prefixes_apart(server, client) -> None:
    """SGLang's extra_key (and cache_salt on the OpenAI routes): a prompt cached under one
    key is a hit for that key only, so one tenant's time to first token says nothing of
    another's prompts."""
    prompt = "Salted prefix: the cache must not share these tokens between tenants, ever."

    def cached(**key: str) -> int:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}, **key}
        return server.post("/generate", json=body).json()["meta_info"]["cached_tokens"]

    cached(extra_key="tenant-a")
    assert cached(extra_key="tenant-a") > 1
    assert cached(extra_key="tenant-b") == 0
    assert cached() <= 1  # no key is a key of its own: at most the BOS other tests sent
    # a salt alone on an OpenAI route is SGLang's extra_key of the same value
    completion(client, prompt, max_tokens=1, extra_body={"cache_salt": "tenant-c"})
    assert cached(extra_key="tenant-c") > 1
    completion(client, prompt, max_tokens=1, extra_body={"cache_salt": "x", "extra_key": "y"})
    assert cached(extra_key="xy") == 0  # the two parts are kept apart
    with pytest.raises(openai.BadRequestError, match="at most 256 characters"):
        completion(client, prompt, extra_body={"extra_key": "k" * 257})


def test_weight_version_and_sagemaker_routes(server) -> None:
    """SGLang's weight-version label: read, relabelled with the admin key (the shared key
    is refused), carried in /generate's meta_info; SageMaker's /ping (public) and
    /invocations (chat completions)."""
    assert server.get("/weight_version").json() == {"weight_version": "default"}
    assert server.get("/ping", key=None).status_code == 200
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "ignore_eos": True,
    }  # fmt: skip (sampled: an end token would cut it short)
    answer = server.post("/invocations", json=chat).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 3
    assert server.post("/update_weight_version", json={"new_version": "v2"}).status_code == 401
    try:
        r = server.post("/update_weight_version", json={"new_version": "v2"}, key=ADMIN_KEY)
        assert r.json() == {
            "success": True,
            "message": "Weight version updated to v2",
            "new_version": "v2",
        }
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        assert server.post("/generate", json=body).json()["meta_info"]["weight_version"] == "v2"
        assert server.get("/get_weight_version").json() == {"weight_version": "v2"}
        assert server.get("/get_model_info").json()["weight_version"] == "v2"
    finally:
        server.post("/update_weight_version", json={"new_version": "default"}, key=ADMIN_KEY)


def test_info_and_health_endpoints(server) -> None:
    assert server.get("/health_generate", key=None).status_code == 200
    for path in ("/get_model_info", "/model_info"):  # SGLang's older name and its newer
        info = server.get(path).json()
        assert info["is_generation"] and info["served_model_name"] == "tiny"
    for path in ("/get_server_info", "/server_info"):
        sinfo = server.get(path).json()
        assert sinfo["enable_metrics"] is True and sinfo["max_total_tokens"] == 4096
    assert server.get("/get_server_info", key=None).status_code == 401
    [load] = server.get("/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    r = server.post("/v1/embeddings", json={"input": "x"})  # a generation model
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]


def test_get_load_counts_requests_and_their_tokens(server) -> None:
    """/get_load (what SGLang's router polls) while streams run: the requests in flight
    and, for each, its prompt plus what it has made so far; nothing once they end."""
    prompt, new, streams = "Hello there", 200, 4
    prompt_len = len(server.post("/v1/tokenize", json={"prompt": prompt}).json()["tokens"])

    async def run() -> dict[str, int]:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as http:
            task = asyncio.gather(
                asyncio.to_thread(stream_completions, server, [prompt] * streams, new)
            )
            deadline, seen = time.monotonic() + 60, None
            while time.monotonic() < deadline and not task.done():
                [load] = (await http.get("/get_load")).json()
                if load["num_reqs"] - load["num_waiting_reqs"] >= 2:
                    seen = load
                    break
                await asyncio.sleep(0.005)
            await task
            assert seen is not None, "two streams never ran at once"
            return seen

    load = asyncio.run(run())
    running = load["num_reqs"] - load["num_waiting_reqs"]
    assert running * prompt_len <= load["num_tokens"] <= load["num_reqs"] * (prompt_len + new)
    [idle] = server.get("/get_load").json()
    assert idle == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_tokenize_and_detokenize(server, engine) -> None:
    """SGLang's /v1/tokenize and /v1/detokenize (and /tokenize, /detokenize) answer as the
    model's tokenizer does; ids outside the vocabulary are a 400, not silently dropped."""
    tok, text = engine.tokenizer, "The capital of France"
    body = server.post("/v1/tokenize", json={"prompt": text, "model": "tiny"}).json()
    ids = tok.encode(text)
    assert body == {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length}
    bos = tok.special_tokens_map["bos_token"]
    assert tok.decode(ids[:1]) == bos  # special tokens by default
    bare = [tok.encode(t, add_special_tokens=False) for t in (text, "x", "")]
    body = server.post(
        "/tokenize", json={"prompt": [text, "x", ""], "add_special_tokens": False}
    ).json()
    assert body["tokens"] == bare and body["count"] == [len(b) for b in bare]
    r = server.post("/v1/detokenize", json={"tokens": ids})
    assert r.json() == {"text": tok.decode(ids, skip_special_tokens=True)} == {"text": text}
    body = {"tokens": [ids, [], ids[:2]], "skip_special_tokens": False}
    r = server.post("/detokenize", json=body)
    assert r.json()["text"] == [tok.decode(ids), "", tok.decode(ids[:2])]
    assert r.json()["text"][0].startswith(bos)
    assert server.post("/v1/detokenize", json={"tokens": []}).json() == {"text": ""}
    vocab = engine.art.spec.vocab_size
    for bad in ([-1], [[1], [vocab]], [1, [2]], "abc"):
        r = server.post("/v1/detokenize", json={"tokens": bad})
        assert r.status_code == 400, r.text
    r = server.post("/v1/detokenize", json={"tokens": [[1], [vocab, 3]]})
    assert f"[0, {vocab}): [{vocab}]" in r.json()["error"]["message"]
    for bad in ({"prompt": 5}, {"prompt": [1, 2]}, {"prompt": "x", "add_special_tokens": 1}):
        assert server.post("/v1/tokenize", json=bad).status_code == 400
    assert server.post("/v1/tokenize", json={"prompt": "x"}, key=None).status_code == 401


def test_metrics(server, client) -> None:
    completion(client, "Hello")
    text = server.get("/metrics", key=None).text
    for name in (
        "kiln:time_to_first_token_seconds_count",
        "kiln:inter_token_latency_seconds",
        "kiln:e2e_request_latency_seconds_bucket",
        "kiln:generation_tokens_total",
        "kiln:prompt_tokens_total",
        "kiln:num_running_reqs",
        "kiln:num_queue_reqs",
        "kiln:cache_hit_rate",
    ):
        assert name in text, name
    assert metric(text, "kiln:time_to_first_token_seconds_count") >= 1
    # --collect-tokens-histogram: one observation a finished request, in the given buckets
    finished = metric(text, "kiln:num_requests_total", model_name="tiny")  # SGLang's label
    assert metric(text, "kiln:generation_tokens_histogram_count") == finished >= 1
    assert metric(text, "kiln:prompt_tokens_histogram_count") == finished
    assert metric(text, "kiln:generation_tokens_histogram_bucket", le="12.0") >= 1  # "Hello"'s 12
    assert metric(text, "kiln:prompt_tokens_histogram_bucket", le="1.1e+06")  # SGLang's default
    with pytest.raises(KeyError):
        metric(text, "kiln:generation_tokens_histogram_bucket", le="100.0")


def test_queue_limit_answers_503_and_sigterm_exits_cleanly(artefact, launch) -> None:
    small = launch(
        artefact("llama"),
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
        "--max-total-tokens",
        "1024",
        "--skip-server-warmup",
    )

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=small.url, timeout=120) as c:
            body = {"model": "m", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
            # One runs, one waits, the rest find the queue full.
            tasks = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(4)]
            responses = await asyncio.gather(*tasks)
            for r in responses:
                if r.status_code == 503:
                    assert "--max-queued-requests 1" in r.json()["message"]
            return [r.status_code for r in responses]

    codes = asyncio.run(run())
    assert 503 in codes and 200 in codes, codes
    stop_server(small)
    assert small.process.poll() is not None


def test_logit_bias_and_unsupported_fields(server, client, engine) -> None:
    params = {**GREEDY, "max_new_tokens": 4}
    first = server.post("/generate", json={"text": "Hello", "sampling_params": params})
    banned = first.json()["output_ids"][0]
    params["logit_bias"] = {str(banned): -100}
    out = server.post("/generate", json={"text": "Hello", "sampling_params": params}).json()
    assert banned not in out["output_ids"]
    forced = completion(client, "Hello", max_tokens=3, logit_bias={"42": 100})
    assert forced.choices[0].text == engine.tokenizer.decode([42, 42, 42])
    for body, field in (
        ({"prompt": "x", "lora_path": "a"}, "lora_path"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias names tokens outside"),
        ({"prompt": "x", "logit_bias": {"1": 500}}, r"logit_bias values must be in \[-100, 100\]"),
    ):
        r = server.post("/v1/completions", json={"model": "tiny", **body})
        assert r.status_code == 400 and __import__("re").search(field, r.json()["message"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for extra, field in (
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools: this server reads no tool calls (start it with --tool-call-parser",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ):
        r = server.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400 and field in r.json()["message"], r.text
    r = server.post(
        "/v1/chat/completions", json={**chat, "response_format": {"type": "text"}, "max_tokens": 2}
    )
    assert r.status_code == 200


def test_echo_with_logprobs_scores_the_prompt(client, server, engine) -> None:
    """A scorer's request (lm-eval's loglikelihood: echo, logprobs, max_tokens 0 or 1):
    the prompt's tokens come back with their logprobs (the first null), the engine's
    input_token_logprobs, then the generated ones; streamed the same; SGLang's
    logprob_start_len on /generate gives them from that position on."""
    prompt = [1, 5, 9, 33, 7, 12, 40]
    want = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=1,
        logprob_start_len=0,
    )["meta_info"]["input_token_logprobs"]
    values = [v for v, *_ in want[1:]]
    for max_tokens in (0, 1):
        out = completion(client, prompt, echo=True, logprobs=1, max_tokens=max_tokens)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(prompt) + max_tokens == len(lp.token_logprobs)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(values, abs=1e-5)
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert out.usage.completion_tokens == max_tokens
    chunks = list(completion(client, prompt, echo=True, logprobs=1, max_tokens=2, stream=True))
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(prompt) + 2 and streamed[0] is None
    assert streamed[1 : len(prompt)] == pytest.approx(values, abs=1e-5)
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 3}
    r = server.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt[3:]
    got = [v for v, _, _ in meta["input_token_logprobs"]]
    assert got == pytest.approx(values[2:], abs=1e-5) and r.json()["output_ids"] == []
    r = server.post("/generate", json={**body, "logprob_start_len": len(prompt)})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]


def test_suffix_needs_a_completion_template(server) -> None:
    body = {"model": "m", "max_tokens": 2, "prompt": "a", "suffix": "b"}
    plain = server.post("/v1/completions", json=body)
    assert plain.status_code == 400 and "--completion-template" in plain.json()["error"]["message"]


def test_suffix_fills_in_the_middle_with_a_completion_template(artefact, launch) -> None:
    """--completion-template: a completion with a suffix is the completion of the prompt
    the template builds (star_coder's: prefix, the suffix after its end token, then the
    middle token); with token ids a suffix is a 400."""
    fim = launch(artefact("llama"), "--completion-template", "star_coder", "--skip-server-warmup")
    body = {"model": "m", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = fim.post("/v1/completions", json={**body, "prompt": "def f(", "suffix": "    return x"})
    wrapped = "<fim_prefix>def f(<fim_suffix>    return x<fim_middle>"
    want = fim.post("/v1/completions", json={**body, "prompt": wrapped}).json()
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert got.json()["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    ids = fim.post("/v1/completions", json={**body, "prompt": [1, 2, 3], "suffix": "x"})
    assert ids.status_code == 400 and "text prompts" in ids.json()["error"]["message"]


def test_completion_template_files(tmp_path) -> None:
    from kiln.serve import fim

    spec = {"name": "mine", "fim_begin_token": "<B>", "fim_middle_token": "<M>",
            "fim_end_token": "<E>", "fim_position": "MIDDLE"}  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(spec))
    assert fim.load(str(tmp_path / "t.json")).prompt("p", "s") == "<B>p<M>s<E>"
    assert fim.load("qwen_coder").prompt("p", "s") == "<|fim_prefix|>p<|fim_suffix|>s<|fim_middle|>"
    (tmp_path / "bad.json").write_text(json.dumps({**spec, "fim_position": "START"}))
    for bad, why in (("nope", "neither one of"), (str(tmp_path / "bad.json"), "MIDDLE or END")):
        with pytest.raises(ValueError, match=f"--completion-template .*: .*{why}"):
            fim.load(bad)
