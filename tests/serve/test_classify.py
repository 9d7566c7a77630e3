"""Sequence classifiers and reward models (a checkpoint whose architecture is a
*ForSequenceClassification): compiled as pooling models whose steps end at the score head,
a request's answer is its last token's label logits, checked against transformers' own
classifier (a Llama with three labels; a Qwen2 reward model of one label, on one rank and
on two); served as SGLang's /v1/classify (labels, softmax), /classify and /v1/embeddings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from serve_helpers import API_KEY

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model

PROMPTS = [[1, 5, 9], list(range(3, 30)), [7, 8, 9, 10, 11]]
LABELS = ("negative", "neutral", "positive")


def _classifier(
    checkpoint, root: Path, family: str, labels: tuple[str, ...]
) -> tuple[Path, object]:
    """A tiny `family` checkpoint as transformers' sequence classifier with `labels` (a
    random score head), saved with its tokenizer; and that transformers model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = checkpoint(family)
    torch.manual_seed(1)
    ids = dict(enumerate(labels))
    hf = AutoModelForSequenceClassification.from_pretrained(
        base, id2label=ids, label2id={v: k for k, v in ids.items()}, dtype=torch.float32
    )
    hf.config.pad_token_id = 0
    out = root / f"{family}-classifier"
    hf.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out, hf


def _logits(hf, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return [hf(torch.tensor([ids])).logits[0].double().numpy() for ids in prompts]


@pytest.fixture(scope="module")
def sentiment(checkpoint, tmp_path_factory) -> tuple[Path, object]:
    ckpt, hf = _classifier(checkpoint, tmp_path_factory.mktemp("cls"), "llama", LABELS)
    art = tmp_path_factory.mktemp("cls-art") / "art"
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", device="cpu"), art)
    return art, hf


def test_scores_are_transformers_classifier_logits(sentiment, checkpoint, tmp_path) -> None:
    """A batch of prompts, each its last token's label logits (not normalised), within
    1e-4 of transformers'; a one-label reward model the same, from one rank and from two
    (the score head whole on each); generation is refused."""
    art, hf = sentiment
    engine = Engine(art, max_total_tokens=1024)
    assert engine.art.spec.labels == LABELS and engine.art.spec.is_embedding
    got = engine.embed(input_ids=PROMPTS)
    for g, want in zip(got, _logits(hf, PROMPTS), strict=True):
        assert len(g["embedding"]) == 3
        assert np.allclose(g["embedding"], want, atol=1e-4), (g["embedding"], want)
    with pytest.raises(ValueError, match="embedding model"):
        engine.generate("hi")
    with pytest.raises(ValueError, match="Matryoshka"):
        engine.embed(input_ids=PROMPTS[0], dimensions=2)
    engine.shutdown()


@pytest.fixture(scope="module")
def reward(checkpoint, tmp_path_factory) -> tuple[Path, Path, object]:
    """A one-label Qwen2 reward model: its checkpoint, artefact and transformers model."""
    root = tmp_path_factory.mktemp("rm")
    ckpt, hf = _classifier(checkpoint, root, "qwen2", ("score",))
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", device="cpu"), root / "art")
    return ckpt, root / "art", hf


def test_a_reward_models_score_on_one_rank_and_two(reward, tmp_path) -> None:
    ckpt, art, hf = reward
    want = _logits(hf, PROMPTS)
    two = tmp_path / "rm-tp2"
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", device="cpu", tp_size=2), two)
    for out in (art, two):
        rm = Engine(out, max_total_tokens=1024)
        try:
            for g, w in zip(rm.embed(input_ids=PROMPTS), want, strict=True):
                assert len(g["embedding"]) == 1 and abs(g["embedding"][0] - w[0]) < 1e-4, out
        finally:
            rm.shutdown()


def test_rerank_orders_documents_by_a_one_label_models_score(
    reward, sentiment_server, launch
) -> None:
    """/v1/rerank: the query and each document as the tokenizer's text pair, scored by the
    one-label model (transformers' tokenizer(query, document) and logit), highest first;
    a model of more labels is a 400."""
    from transformers import AutoTokenizer

    ckpt, art, hf = reward
    query, docs = "kiln", ["a hot oven", "cold water", "fired clay pots", "x"]
    tok = AutoTokenizer.from_pretrained(ckpt)
    pairs = [tok(query, d)["input_ids"] for d in docs]
    scores = [float(w[0]) for w in _logits(hf, pairs)]
    server = launch(art, "--api-key", API_KEY)
    r = server.post("/v1/rerank", json={"query": query, "documents": docs})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [g["index"] for g in got] == sorted(range(4), key=lambda i: -scores[i])
    for g in got:
        assert g["document"] == docs[g["index"]] and abs(g["score"] - scores[g["index"]]) < 1e-4
        assert g["meta_info"]["prompt_tokens"] == len(pairs[g["index"]])
    # as SGLang's router forwards it: its own fields filled in
    routed = {"query": query, "documents": docs, "model": "unknown", "return_documents": False,
              "rid": None, "user": None}  # fmt: skip
    r = server.post("/v1/rerank", json=routed)
    assert r.status_code == 200 and [g["index"] for g in r.json()] == [g["index"] for g in got]
    assert all("document" not in g for g in r.json())
    r = server.post("/v1/rerank", json={"query": query, "documents": ["ok", ""]})
    assert r.status_code == 400 and "non-empty" in r.json()["error"]["message"]
    r = sentiment_server.post("/v1/rerank", json={"query": query, "documents": docs})
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def sentiment_server(sentiment, launch):
    return launch(sentiment[0], "--api-key", API_KEY, "--served-model-name", "cls")


def test_the_server_classifies(sentiment, sentiment_server) -> None:
    """/v1/classify: each input's label (the highest logit) and the softmax over the
    labels, for text and token ids; /classify (SGLang's reward-model route) and
    /v1/embeddings give the logits themselves."""
    hf, server = sentiment[1], sentiment_server
    r = server.post("/v1/classify", json={"model": "cls", "input": PROMPTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    for item, want in zip(body["data"], _logits(hf, PROMPTS), strict=True):
        probs = np.exp(want - want.max())
        probs /= probs.sum()
        assert item["label"] == LABELS[int(want.argmax())] and item["num_classes"] == 3
        assert np.allclose(item["probs"], probs, atol=1e-5)
    text = server.post("/v1/classify", json={"input": "The kiln is hot"}).json()["data"]
    raw = server.post("/classify", json={"text": "The kiln is hot"}).json()["embedding"]
    assert text[0]["label"] == LABELS[int(np.argmax(raw))] and len(raw) == 3
    emb = server.post("/v1/embeddings", json={"input": "The kiln is hot"}).json()
    assert np.allclose(emb["data"][0]["embedding"], raw, atol=1e-6)
    r = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 400
