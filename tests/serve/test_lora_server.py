"""LoRA adapters through a real `kiln serve --lora-paths ...` on loopback: SGLang's
/generate lora_path (one, or one per prompt), the OpenAI routes' model "SERVED:ADAPTER"
(SGLang's form), the adapter's own name (vLLM's, as /v1/models lists them) and lora_path
in the body; each answer transformers' greedy tokens with that adapter merged."""

from __future__ import annotations

import openai
import pytest
from lora_files import merged_model, write_adapter
from oracle import hf_greedy
from serve_helpers import API_KEY

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
    server = launch(artefact("llama"), "--lora-paths", *(f"{k}={v}" for k, v in paths.items()))
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
