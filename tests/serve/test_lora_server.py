"""LoRA adapters through a real `kiln serve --lora-paths ...` on loopback: SGLang's
/generate lora_path (one, or one per prompt), the OpenAI routes' model "SERVED:ADAPTER"
(SGLang's form), the adapter's own name (vLLM's, as /v1/models lists them) and lora_path
in the body; each answer transformers' greedy tokens with that adapter merged. Adapters
loaded and unloaded while serving (/load_lora_adapter, /unload_lora_adapter: the admin
key's)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from lora_files import merged_model, write_adapter
from oracle import hf_greedy
from serve_helpers import ADMIN_KEY, API_KEY

from kiln.serve import replay

PROMPT = [5, 17, 33, 8, 91, 12]
NEW = 8


@pytest.fixture(scope="module")
def served(artefact, checkpoint, launch, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    ckpt = checkpoint("llama")
    paths = {
        "sql": write_adapter(ckpt, root / "sql", seed=3),
        "py": write_adapter(ckpt, root / "py", 2, 4.0, ("q_proj", "v_proj"), seed=4),
    }
    keys = ("--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
    adapters = (f"{k}={v}" for k, v in paths.items())
    server = launch(artefact("llama"), *keys, "--lora-paths", *adapters)
    want = {name: hf_greedy(merged_model(ckpt, p), PROMPT, NEW) for name, p in paths.items()}
    want[None] = hf_greedy(merged_model(ckpt, None), PROMPT, NEW)
    return server, want


def test_generate_takes_an_adapter_per_prompt(served) -> None:
    server, want = served
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    loras = [None, "sql", "py", "sql"]
    body = {"input_ids": [PROMPT] * 4, "sampling_params": params, "lora_path": loras}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [want[x] for x in loras]
    assert len({tuple(want[x]) for x in loras}) == 3  # each adapter changes the output
    one = server.post("/generate", json={**body, "input_ids": PROMPT, "lora_path": "py"})
    assert one.json()["output_ids"] == want["py"]


def test_openai_routes_name_the_adapter(served) -> None:
    server, want = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    listed = client.models.list().data
    base = listed[0].id
    assert [(m.id, getattr(m, "parent", None)) for m in listed] == [
        (base, None),
        ("sql", base),
        ("py", base),
    ]
    assert client.models.retrieve("py").id == "py"
    greedy = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def text(model: str, **extra) -> str:
        out = client.completions.create(model=model, prompt=PROMPT, **{**greedy, **extra})
        return out.choices[0].text

    def expected(name: str | None) -> str:
        r = server.post("/v1/detokenize", json={"tokens": want[name]})
        return r.json()["text"]

    body = {"ignore_eos": True}
    assert text(f"{base}:sql") == expected("sql")  # SGLang's form
    assert text("py") == expected("py")  # vLLM's: the adapter's own name
    assert text(base, extra_body={**body, "lora_path": "sql"}) == expected("sql")
    # the model field's adapter wins over lora_path, as in SGLang
    assert text(f"{base}:py", extra_body={**body, "lora_path": "sql"}) == expected("py")
    assert text(base) == expected(None)
    assert len({expected(x) for x in ("sql", "py", None)}) == 3
    chat = client.chat.completions.create(
        model=f"{base}:sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content is not None


def test_an_unknown_adapter_is_a_400_and_the_server_keeps_serving(served) -> None:
    server, want = served
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    for path, body in [
        ("/generate", {"input_ids": PROMPT, "sampling_params": params, "lora_path": "nope"}),
        ("/v1/completions", {"model": "x", "prompt": "hi", "lora_path": "nope"}),
        ("/generate", {"input_ids": [PROMPT] * 2, "lora_path": ["sql"]}),
    ]:
        r = server.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "lora_path" in r.json()["error"]["message"]
    base = server.get("/v1/models").json()["data"][0]["id"]
    r = server.post("/v1/completions", json={"model": f"{base}:nope", "prompt": "hi"})
    assert r.status_code == 400 and "no LoRA adapter 'nope'" in r.json()["error"]["message"]
    r = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": params})
    assert r.json()["output_ids"] == want[None]


def test_kiln_replay_sends_a_dumped_request_with_its_adapter(served) -> None:
    server, want = served
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    dumped = [
        {"rid": f"r{i}", "created": 0.0, "input_ids": PROMPT, "sampling_params": params}
        | ({"lora_path": lora} if lora else {})
        for i, lora in enumerate(["py", None])
    ]
    answers = replay.replay(dumped, server.url, API_KEY)
    assert [a.body["output_ids"] for a in answers] == [want["py"], want[None]]


def test_adapters_load_and_unload_while_serving(served, checkpoint, tmp_path) -> None:
    server, want = served
    ckpt = checkpoint("llama")
    first = write_adapter(ckpt, tmp_path / "late-1", 3, 6.0, ("q_proj", "o_proj"), seed=5)
    second = write_adapter(ckpt, tmp_path / "late-2", 3, 6.0, ("up_proj",), seed=6)
    late = {p: hf_greedy(merged_model(ckpt, p), PROMPT, NEW) for p in (first, second)}
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    body = {"input_ids": PROMPT, "sampling_params": params, "lora_path": "late"}
    load = {"lora_name": "late", "lora_path": str(first)}
    assert server.post("/load_lora_adapter", json=load).status_code == 401  # the shared key
    r = server.post("/load_lora_adapter", json=load, key=ADMIN_KEY)
    assert r.status_code == 200, r.text
    assert r.json()["loaded_adapters"]["late"] == str(first)
    assert "late" in [m["id"] for m in server.get("/v1/models").json()["data"]]
    out = server.post("/generate", json=body).json()
    assert out["output_ids"] == late[first] != want[None]
    again = server.post("/load_lora_adapter", json=load, key=ADMIN_KEY)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    missing = {"lora_name": "other", "lora_path": str(tmp_path / "nothing")}
    r = server.post("/load_lora_adapter", json=missing, key=ADMIN_KEY)
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]

    # unloaded while a request of it streams: that request ends as it began
    stream_body = {**body, "stream": True, "sampling_params": {**params, "max_new_tokens": 40}}
    chunks = []
    with httpx.stream("POST", server.url + "/generate", json=stream_body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 1:
                    gone = server.post("/unload_lora_adapter", json={"lora_name": "late"},
                                       key=ADMIN_KEY)  # fmt: skip
                    assert gone.status_code == 200 and "late" not in gone.json()["loaded_adapters"]
    assert chunks[-1]["output_ids"][:NEW] == late[first]
    assert len(chunks[-1]["output_ids"]) == 40
    r = server.post("/generate", json=body)
    assert r.status_code == 400 and "no LoRA adapter 'late'" in r.json()["error"]["message"]

    # the same name from another folder: its own answers, none of the old one's cache
    load = {"lora_name": "late", "lora_path": str(second)}
    assert server.post("/load_lora_adapter", json=load, key=ADMIN_KEY).status_code == 200
    out = server.post("/generate", json=body).json()
    assert out["output_ids"] == late[second] != late[first]
    assert out["meta_info"]["cached_tokens"] == 0
    server.post("/unload_lora_adapter", json={"lora_name": "late"}, key=ADMIN_KEY)
