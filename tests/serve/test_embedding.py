"""Embedding models (SGLang's --is-embedding): the graph ends at the final norm, a request
is its prompt and the last token's hidden state, L2-normalised, checked against
transformers' base model; served as OpenAI's /v1/embeddings and SGLang's /encode, with
generation refused (and embeddings refused by a generation server)."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from serve_helpers import API_KEY

from kiln import Engine
from kiln.runtime.engine import RequestError

PROMPTS = [[1, 5, 9], list(range(3, 30)), [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def art(artefact):
    return artefact("llama", compile_args={"is_embedding": True})


@pytest.fixture(scope="module")
def engine(art) -> Engine:
    return Engine(art, max_total_tokens=1024)


def transformers_embeddings(
    checkpoint, prompts: list[list[int]], dimensions: int | None = None, **config: Any
) -> list[np.ndarray]:
    """Each prompt's last hidden state (its first `dimensions` features) over its norm,
    from transformers' base model with `config`'s fields replacing the checkpoint's."""
    import torch
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(checkpoint("llama"), torch_dtype=torch.float32, **config)
    out = []
    with torch.no_grad():
        for ids in prompts:
            last = hf(torch.tensor([ids])).last_hidden_state[0, -1, :dimensions].double()
            out.append((last / last.norm()).numpy())
    return out


def test_embeddings_are_transformers_last_hidden_state(engine, art, artefact, checkpoint):
    """Each prompt's vector is transformers' last hidden state of its last token over its
    norm: batched, alone again through the prefix cache, in prompt chunks of 5, and from a
    two-rank artefact; generation is refused, as embed() is by a generation model."""
    want = transformers_embeddings(checkpoint, PROMPTS)
    got = engine.embed(input_ids=PROMPTS)
    assert len(got) == 3
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g["embedding"], w, atol=1e-5)
        assert np.linalg.norm(g["embedding"]) == pytest.approx(1.0)
        assert g["meta_info"]["prompt_tokens"] == len(PROMPTS[got.index(g)])
    again = engine.embed(input_ids=PROMPTS[1])
    assert again["meta_info"]["cached_tokens"] > 0
    assert np.allclose(again["embedding"], want[1], atol=1e-5)
    chunked = Engine(art, max_total_tokens=1024, chunked_prefill_size=5)
    assert np.allclose(chunked.embed(input_ids=PROMPTS[1])["embedding"], want[1], atol=1e-5)
    two = Engine(artefact("llama", compile_args={"is_embedding": True, "tp_size": 2}))
    assert np.allclose(two.embed(input_ids=PROMPTS[2])["embedding"], want[2], atol=1e-5)
    with pytest.raises(RequestError, match="embedding model"):
        engine.generate(input_ids=PROMPTS[0])
    with pytest.raises(RequestError, match="--is-embedding"):
        Engine(artefact("llama"), max_total_tokens=256).embed(input_ids=PROMPTS[0])


def test_the_server_answers_embeddings_and_refuses_generation(art, engine, launch) -> None:
    server = launch(art, "--api-key", API_KEY, "--served-model-name", "emb")
    texts = ["The capital of France", "hello"]
    want = [e["embedding"] for e in engine.embed(prompt=texts)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    out = client.embeddings.create(model="emb", input=texts)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1] and out.model == "emb"
    for d, w in zip(out.data, want, strict=True):
        assert np.allclose(d.embedding, w, atol=1e-7)
    assert out.usage.prompt_tokens == sum(len(engine.encode(t)) for t in texts)
    floats = server.post("/v1/embeddings", json={"input": [[1, 5, 9]], "encoding_format": "float"})
    assert floats.json()["data"][0]["embedding"] == pytest.approx(
        engine.embed(input_ids=[1, 5, 9])["embedding"], abs=1e-7
    )
    raw = server.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    assert np.allclose(vector, want[1], atol=1e-7)
    one = server.post("/encode", json={"text": "hello"}).json()
    # against the server's own answer for "hello" alone: `want` ran it beside another prompt
    # (or not: the engine's loop batches what has arrived), whose sums may round a few ulps
    # apart, as the relative tolerance of the np.allclose checks above allows
    assert one["embedding"] == pytest.approx(vector.tolist(), abs=1e-7)
    batch = server.post("/encode", json={"input_ids": PROMPTS}).json()
    assert len(batch) == 3 and batch[2]["meta_info"]["prompt_tokens"] == 5
    for path, body in (
        ("/v1/completions", {"model": "emb", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "emb", "messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"text": "hi"}),
    ):
        r = server.post(path, json=body)
        assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], path
    r = server.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
    assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]
    r = server.post("/v1/classify", json={"input": "x"})
    assert r.status_code == 400 and "not a sequence classifier" in r.json()["error"]["message"]
    assert server.get("/get_model_info").json()["is_generation"] is False
    assert server.get("/health_generate", key=None).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_matryoshka_dimensions_from_config_overrides(engine, artefact, checkpoint, launch):
    """--json-model-override-args sets config fields the checkpoint lacks or holds
    otherwise: Matryoshka widths (8 and 16) and another rms_norm_eps. A request's
    `dimensions` gives transformers' last hidden state (with that eps), its first d
    features over their norm; other widths, and any on a model without Matryoshka widths,
    are refused; over HTTP through the openai client and /encode."""
    overrides = '{"matryoshka_dimensions": [16, 8], "rms_norm_eps": 0.25}'
    flags = {"is_embedding": True, "json_model_override_args": overrides}
    cut = artefact("llama", compile_args=flags)
    mat = Engine(cut, max_total_tokens=1024)
    want = transformers_embeddings(checkpoint, PROMPTS, dimensions=8, rms_norm_eps=0.25)
    for g, w in zip(mat.embed(input_ids=PROMPTS, dimensions=8), want, strict=True):
        assert len(g["embedding"]) == 8 and np.allclose(g["embedding"], w, atol=1e-5)
    whole = mat.embed(input_ids=PROMPTS[0])["embedding"]
    (eps,) = transformers_embeddings(checkpoint, PROMPTS[:1], rms_norm_eps=0.25)
    assert len(whole) == 96 and np.allclose(whole, eps, atol=1e-5)
    # the override reached the model: the checkpoint's own eps gives another vector
    assert not np.allclose(whole, engine.embed(input_ids=PROMPTS[0])["embedding"], atol=1e-3)
    for bad, message in ((12, r"trained for \[8, 16\] only"), (0, r"in \[1, 96\]"), (97, "96")):
        with pytest.raises(RequestError, match=message):
            mat.embed(input_ids=PROMPTS[0], dimensions=bad)
    with pytest.raises(RequestError, match="not trained for Matryoshka"):
        engine.embed(input_ids=PROMPTS[0], dimensions=8)

    server = launch(cut, "--api-key", API_KEY, "--served-model-name", "emb")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    out = client.embeddings.create(model="emb", input=[[1, 5, 9]], dimensions=16)
    want16 = mat.embed(input_ids=[1, 5, 9], dimensions=16)["embedding"]
    assert len(out.data[0].embedding) == 16
    assert np.allclose(out.data[0].embedding, want16, atol=1e-7)
    with pytest.raises(openai.BadRequestError, match="trained for"):
        client.embeddings.create(model="emb", input="x", dimensions=12)
    one = server.post("/encode", json={"input_ids": [1, 5, 9], "dimensions": 8}).json()
    assert one["embedding"] == pytest.approx(want[0], abs=1e-5)
