"""Server flags that change behaviour: chat template file, metric buckets, truncation,
cache reporting and flushing, and `kiln launch`."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from serve_helpers import metric, start_kiln, stop_server

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("metrics") / "exported"  # made by the server


@pytest.fixture(scope="module")
def server(artefact, launch, tmp_path_factory, metrics_dir):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    return launch(
        artefact("qwen2"),
        "--chat-template",
        str(template),
        "--enable-metrics",
        "--bucket-time-to-first-token",
        "0.25",
        "0.5",
        "7.5",
        "--allow-auto-truncate",
        "--enable-cache-report",
        "--max-total-tokens",
        "2048",
        "--served-model-name",
        "m",
        "--stream-interval",
        "4",
        "--abort-on-priority-when-disabled",
        "--fastapi-root-path",
        "/kiln",
        "--enable-tokenizer-batch-encode",
        "--tokenizer-metrics-allowed-custom-labels",
        "team",
        "tier",
        "--export-metrics-to-file",
        "--export-metrics-to-file-dir",
        str(metrics_dir),
        "--multi-item-scoring-delimiter",
        "3",
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_chat_template_file_is_used(client, artefact) -> None:
    from kiln import Engine

    engine = Engine(artefact("qwen2"), max_total_tokens=512)
    text = "[system] Be brief.\n[user] Hi\n[assistant]"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    expected = engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    )
    out = client.chat.completions.create(
        model="m",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == expected["text"]


def test_metric_buckets_follow_the_flags(server, client) -> None:
    client.completions.create(model="m", prompt="Hello", max_tokens=2)
    text = server.get("/metrics", key=None).text
    buckets = [
        line
        for line in text.splitlines()
        if line.startswith("kiln:time_to_first_token_seconds_bucket") and 'team=""' in line
    ]
    assert [b.split('le="')[1].split('"')[0] for b in buckets] == ["0.25", "0.5", "7.5", "+Inf"]


def test_custom_metric_labels_from_the_header(server, client) -> None:
    """SGLang's scheme: the allowed labels a request's x-custom-labels JSON gives label its
    series (others dropped, "" when absent); a malformed header is a 400 and the server
    serves on."""
    before = server.get("/metrics", key=None).text
    sent = {"team": "search", "tier": 2, "user": "dropped"}
    client.completions.create(
        model="m",
        prompt="Hello",
        max_tokens=2,
        extra_headers={"x-custom-labels": json.dumps(sent)},
    )
    text = server.get("/metrics", key=None).text
    mine = {"model_name": "m", "team": "search", "tier": "2"}
    assert metric(text, "kiln:num_requests_total", **mine) == 1 + _or_zero(
        before, "kiln:num_requests_total", **mine
    )
    assert metric(text, "kiln:time_to_first_token_seconds_count", **mine) >= 1
    assert "user=" not in text and "dropped" not in text
    for bad, why in (
        ("{not json", "not JSON"),
        ('["team"]', "a JSON object"),
        ('{"team": {"a": 1}}', "a string or number"),
        (json.dumps({"team": "x" * 129}), "over 128 characters"),
    ):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "m", "prompt": "Hi", "max_tokens": 1},
            headers={"x-custom-labels": bad},
            timeout=30,
        )
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert client.completions.create(model="m", prompt="Hi", max_tokens=1).choices


def test_metrics_exported_to_file(server, client, metrics_dir) -> None:
    """--export-metrics-to-file: a JSON line for each request that ends, with its custom
    labels and sampling parameters, never its texts; the warm-up probe left out."""
    client.completions.create(
        model="m",
        prompt="Exported once",
        max_tokens=3,
        extra_headers={"x-custom-labels": json.dumps({"team": "export"})},
        extra_body={"ignore_eos": True},  # sampled: an EOS at the third token ended it once
    )
    record = None
    for _ in range(100):  # written on the log thread
        files = sorted(metrics_dir.glob("kiln-request-metrics-*.log"))
        lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
        mine = [r for r in lines if r.get("custom_labels") == {"team": "export"}]
        if mine:
            record = mine[0]
            break
        time.sleep(0.05)
    assert record is not None, lines
    assert re.fullmatch(r"kiln-request-metrics-\d{8}_\d{2}\.log", files[-1].name)
    assert record["model_name"] == "m" and record["completion_tokens"] == 3
    assert record["sampling_params"]["max_new_tokens"] == 3 and record["e2e_latency"] > 0
    assert record["finish_reason"]["type"] == "length" and "T" in record["time"]
    assert "Exported" not in json.dumps(lines)  # no prompt text
    assert not any(r["rid"].startswith("HEALTH_CHECK_") for r in lines)  # nor the probes


def _or_zero(text: str, name: str, **labels: str) -> float:
    try:
        return metric(text, name, **labels)
    except KeyError:
        return 0.0


def test_label_sets_past_the_limit_count_as_other() -> None:
    from kiln.serve.metrics import LabelSets

    sets = LabelSets(("team", "tier"), limit=2)
    assert sets.values({"team": "a"}) == ("a", "")
    assert sets.values({"team": "b", "tier": "1"}) == ("b", "1")
    assert sets.values({"team": "c"}) == ("other", "other")
    assert sets.values({"team": "a"}) == ("a", "")  # a set already seen keeps its series
    assert sets.values(None) == ("other", "other")


def test_custom_label_names_are_checked() -> None:
    from kiln.args import ArgError
    from kiln.serve.metrics import allowed_labels

    assert allowed_labels(["team", "_x1"]) == ("team", "_x1")
    for bad, why in (
        (["1x"], "not a Prometheus label"),
        (["model_name"], "kiln sets"),
        (["le"], "kiln sets"),
        (["a", "a"], "named twice"),
        (["__a"], "not a"),
    ):
        with pytest.raises(ArgError, match=why):
            allowed_labels(bad)


def test_auto_truncate_cuts_long_prompts(client) -> None:
    out = client.completions.create(model="m", prompt="Hello " * 400, max_tokens=1)
    assert out.usage.prompt_tokens == 255  # context 256, one slot left to generate
    assert out.choices[0].finish_reason == "length"


def test_cached_tokens_are_reported_and_flushed(server, client) -> None:
    prompt = "The capital of France is Paris. " * 4
    client.completions.create(model="m", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="m", prompt=prompt, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1
    assert server.get("/get_server_info").json()["kv_pages_cached"] > 0
    flushed = server.post("/flush_cache").json()
    assert flushed["freed_tokens"] > 0
    info = server.get("/get_server_info").json()
    assert info["kv_pages_cached"] == 0 and info["kv_pages_free"] == info["kv_pages_total"]


def test_launch_compiles_through_the_cache_then_serves(checkpoint, tmp_path, fresh_cache) -> None:
    ckpt = checkpoint("llama")
    argv = [
        "launch",
        "--model-path",
        str(ckpt),
        "--dtype",
        "float32",
        "--artefact-dir",
        str(tmp_path / "art"),
        "--max-total-tokens",
        "512",
        "--skip-server-warmup",
    ]
    for attempt, expected in ((1, "compiled: "), (2, "cache hit: ")):
        log = tmp_path / f"launch{attempt}.log"
        server = start_kiln(argv, log)
        try:
            out = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
                model="llama", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 3
        finally:
            stop_server(server)
        assert expected in log.read_text()


def test_priority_field_orders_waiting_requests(artefact, launch) -> None:
    import asyncio
    import time

    import httpx

    # A context long enough that the busy request outlasts the two submissions below.
    srv = launch(
        artefact("llama", max_position_embeddings=8192),
        "--enable-priority-scheduling",
        "--max-running-requests",
        "1",
        "--priority-scheduling-preemption-threshold",
        "1000",
        "--max-total-tokens",
        "8192",
        "--skip-server-warmup",
    )

    async def run() -> dict[str, float]:
        done: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:

            async def send(name: str, priority: int, tokens: int) -> None:
                body = {
                    "model": "m",
                    "prompt": "Hello",
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "priority": priority,
                }
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                done[name] = time.perf_counter()

            busy = asyncio.ensure_future(send("busy", 0, 2000))
            while (await c.get("/get_server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.02)  # until it holds the only running slot
            # Queued behind it, low first; the high-priority one must still go first.
            # Long enough that who ran first shows in completion times, past HTTP jitter.
            low = asyncio.ensure_future(send("low", 1, 300))
            while (await c.get("/get_server_info")).json()["num_queue_reqs"] == 0:
                await asyncio.sleep(0.01)
            await asyncio.gather(low, send("high", 50, 300), busy)
        return done

    done = asyncio.run(run())
    assert done["high"] < done["low"]


def test_cache_hit_rate_metric(server, client) -> None:
    prompt = "One, two, three, four, five, six, seven. " * 3
    for _ in range(2):
        client.completions.create(model="m", prompt=prompt, max_tokens=1)
    rate = metric(server.get("/metrics", key=None).text, "kiln:cache_hit_rate", model_name="m")
    assert 0.0 < rate < 1.0


def test_stream_interval_groups_tokens(server) -> None:
    import json

    import httpx

    lengths = []
    body = {
        "text": "Hello",
        "stream": True,
        "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                lengths.append(len(json.loads(line[6:])["output_ids"]))
    assert lengths == [4, 8, 10]


def test_ctrl_c_shuts_down_cleanly_leaving_no_processes(artefact, launch) -> None:
    import signal
    from pathlib import Path

    srv = launch(artefact("llama"), "--max-total-tokens", "256", "--skip-server-warmup")
    pid = srv.process.pid

    def children() -> list[int]:
        kids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(stat.parent.name))
        return kids

    assert children() == []  # one process: the engine is a thread, not a child
    srv.process.send_signal(signal.SIGINT)
    code = srv.process.wait(timeout=30)
    assert code in (0, -signal.SIGINT, 130)
    assert "Application shutdown complete" in srv.log.read_text()
    assert not Path(f"/proc/{pid}").exists()


def test_priority_without_priority_scheduling_and_a_root_path(server) -> None:
    """--abort-on-priority-when-disabled: a request naming a priority on a server that does
    not schedule by it is a 400 naming the flags, one without is served. --fastapi-root-path:
    the routes stay where they are; the OpenAPI document names the prefix."""
    import httpx

    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    refused = httpx.post(server.url + "/generate", json={**body, "priority": 3}, timeout=60)
    assert refused.status_code == 400
    assert "--abort-on-priority-when-disabled" in refused.json()["message"]
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": 0}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat).status_code == 400
    assert httpx.get(server.url + "/openapi.json").json()["servers"] == [{"url": "/kiln"}]


def test_batch_encode_tokenizes_a_list_as_one_by_one(server) -> None:
    """--enable-tokenizer-batch-encode: a list of texts is tokenized in one call; each
    prompt is what it is alone (ids, order), and an empty one is still a 400."""
    import httpx

    texts = ["Hello there", "A much longer prompt, with punctuation; and more words.", "x"]
    params = {"max_new_tokens": 3, "temperature": 0}
    url = server.url + "/generate"
    together = httpx.post(url, json={"text": texts, "sampling_params": params}).json()
    for text, got in zip(texts, together, strict=True):
        alone = httpx.post(url, json={"text": text, "sampling_params": params}).json()
        assert got["meta_info"]["prompt_tokens"] == alone["meta_info"]["prompt_tokens"]
        assert got["output_ids"] == alone["output_ids"]
    empty = httpx.post(url, json={"text": ["a", ""], "sampling_params": params})
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]


def test_multi_item_scoring_computes_the_query_once(server) -> None:
    """--multi-item-scoring-delimiter: each item's scores are the label tokens' probabilities
    after the query's ids then the item's (tokenized apart, as SGLang packs them), and
    every item's prompt starts from the query's cached K/V."""
    import math

    labels = [7, 40, 2]
    query, items = list(range(30, 50)), [[60, 61], [62], [63, 64, 65]]
    r = server.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    out = r.json()
    for item, got in zip(items, out["scores"], strict=True):
        body = {
            "input_ids": query + item,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "return_logprob": True,
            "token_ids_logprob": labels,
        }
        meta = server.post("/generate", json=body).json()["meta_info"]
        want = [math.exp(v) for v, _, _ in meta["output_token_ids_logprobs"][0]]
        assert got == pytest.approx(want, rel=1e-4)
    # the query's 20 tokens came from the cache for each item
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * len(query)
    text = {"query": "Is the sky blue?", "items": [" yes", " no"], "label_token_ids": labels}
    r = server.post("/v1/score", json=text)
    assert r.status_code == 200 and len(r.json()["scores"]) == 2, r.text

    def count(text: str, special: bool) -> int:
        body = {"prompt": text, "add_special_tokens": special}
        return len(server.post("/v1/tokenize", json=body).json()["tokens"])

    items_len = count(" yes", False) + count(" no", False)
    assert r.json()["usage"]["prompt_tokens"] == 2 * count(text["query"], True) + items_len
    r = server.post("/v1/score", json={**text, "item_first": True})
    assert r.status_code == 400 and "item_first" in r.text


def test_parallel_samples_prefill_their_prompt_once(client) -> None:
    """n > 1: the prompt is prefilled once ahead (as SGLang's tokenizer manager does), and
    each sample starts from its cached K/V; one sample of a new prompt finds next to
    nothing."""
    one = client.completions.create(
        model="m", prompt="Just one sample, of a new prompt.", max_tokens=2
    )
    assert one.usage.prompt_tokens_details.cached_tokens < 5  # a first token other prompts had
    prompt = "Three samples of one prompt share its keys and values."
    out = client.completions.create(
        model="m", prompt=prompt, max_tokens=2, n=3, temperature=1.0, seed=5
    )
    assert len(out.choices) == 3
    assert out.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - 1
