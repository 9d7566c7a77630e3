"""NGRAM speculative decoding on the real model (SmolLM2-135M-Instruct Q4_1): what it
outputs is what decoding without it outputs, token for token (greedy, and sampled with the
same seed), stop strings, max_tokens and logprobs included, several tokens landing in one
step; its pages go back; and a real `kiln serve` streams it.

The engine's planner drafts only where its measured step costs say drafts pay; these
tests pin a cost model in which rows are free (`FREE_ROWS`), so every offered draft is
verified whatever machine runs them (runtime/speculative.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import API_KEY

from kiln import Engine
from kiln.example import fetch
from kiln.runtime.speculative import StepCosts

# One xdist worker runs every test of the real SmolLM2 file's compiles (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("smollm2")

FREE_ROWS = StepCosts({1: 1.0, 64: 1.0}, 64, fixed=True)
# Prompts whose continuations repeat what came before (drafts get kept) and one that does not.
PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
    "kiwi, lemon. Again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def arts(real_artefact) -> tuple[Path, Path]:
    smollm2 = fetch("smollm2")
    return real_artefact(smollm2), real_artefact(smollm2, speculative_algorithm="NGRAM")


@pytest.fixture(scope="module")
def engines(arts: tuple[Path, Path]) -> tuple[Engine, Engine]:
    plain = Engine(arts[0], max_total_tokens=4096)
    ngram = Engine(arts[1], max_total_tokens=4096)
    assert ngram.step_costs is not None  # measured at start
    ngram.step_costs = FREE_ROWS
    return plain, ngram


def _alone(engine: Engine, prompt: str, params: dict, **kw) -> dict:
    return engine.generate(prompt, params, **kw)


def test_greedy_output_is_decodings_token_for_token(engines: tuple[Engine, Engine]) -> None:
    plain, ngram = engines
    params = {"temperature": 0, "max_new_tokens": 48}
    want = [_alone(plain, p, params)["output_ids"] for p in PROMPTS]
    # Together in one batch: each request's drafts and verify rows beside the others'.
    got = ngram.generate(PROMPTS, params)
    assert [g["output_ids"] for g in got] == want
    meta = [g["meta_info"] for g in got]
    assert sum(m["spec_accept_token_num"] for m in meta) > 10
    assert max(m["spec_accept_length"] for m in meta) > 1.5  # several tokens a step
    assert all(m["spec_accept_token_num"] <= m["spec_draft_token_num"] for m in meta)


def test_sampled_output_with_penalties_and_logprobs_is_decodings(
    engines: tuple[Engine, Engine],
) -> None:
    plain, ngram = engines
    params = {
        "temperature": 0.7,
        "top_p": 0.95,
        "frequency_penalty": 0.2,
        "sampling_seed": 1234,
        "max_new_tokens": 40,
    }
    for prompt in PROMPTS[:2]:
        want = plain.generate(prompt, params, return_logprob=True, top_logprobs_num=2)
        got = ngram.generate(prompt, params, return_logprob=True, top_logprobs_num=2)
        assert got["output_ids"] == want["output_ids"]
        w, g = want["meta_info"], got["meta_info"]
        assert [t for _, t, _ in g["output_token_logprobs"]] == got["output_ids"]
        assert [lp for lp, *_ in g["output_token_logprobs"]] == pytest.approx(
            [lp for lp, *_ in w["output_token_logprobs"]], abs=1e-4
        )
        assert len(g["output_top_logprobs"]) == len(got["output_ids"])
    assert got["meta_info"]["spec_verify_ct"] > 0


@pytest.mark.parametrize(
    "params",
    [
        {"stop": [" fig"]},
        {"stop": ["b, sub"], "no_stop_trim": True},
        {"max_new_tokens": 7},
        {"stop_token_ids": [28]},
    ],
    ids=["stop", "stop-kept", "max-tokens", "stop-token"],
)
def test_stops_and_lengths_land_where_decoding_puts_them(
    engines: tuple[Engine, Engine], params: dict
) -> None:
    plain, ngram = engines
    params = {"temperature": 0, "max_new_tokens": 40, **params}
    for prompt in PROMPTS[:2]:
        want, got = plain.generate(prompt, params), ngram.generate(prompt, params)
        assert got["text"] == want["text"]
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_rejected_drafts_give_their_pages_back(engines: tuple[Engine, Engine]) -> None:
    _, ngram = engines
    pool = ngram.runner.pool
    ngram.flush_cache()
    assert pool.free_pages == pool.num_pages
    for _ in range(3):
        ngram.generate(PROMPTS, {"temperature": 0.9, "max_new_tokens": 24, "sampling_seed": 5})
    assert ngram.flush_cache() >= 0
    assert pool.free_pages == pool.num_pages


def test_a_server_streams_what_it_verifies(arts: tuple[Path, Path], engines, launch) -> None:
    plain, _ = engines
    server = launch(arts[1], "--api-key", API_KEY)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    prompt = PROMPTS[0]
    want = plain.generate(prompt, {"temperature": 0, "max_new_tokens": 32})
    chunks = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == want["text"]
    assert usage is not None and usage.completion_tokens == len(want["output_ids"])
    # SGLang's native API reports the speculation in meta_info.
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    got = httpx.post(
        server.url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    assert got["output_ids"] == want["output_ids"]
    meta = got["meta_info"]
    assert meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
    assert meta["spec_verify_ct"] == 0 or meta["spec_accept_length"] >= 1.0


@pytest.fixture(scope="module")
def standalone(real_artefact) -> tuple[Engine, Engine]:
    """The real model at float32 (its Q4_1 file dequantized), and the same drafted by the
    file as stored with int8 activations: the self-draft case of a quantized model."""
    smollm2 = fetch("smollm2")
    plain = Engine(real_artefact(smollm2, dtype="float32"), max_total_tokens=2048)
    art = real_artefact(
        smollm2,
        dtype="float32",
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(smollm2),
    )
    spec = Engine(art, max_total_tokens=2048)
    spec.step_costs = FREE_ROWS
    return plain, spec


def test_a_quantized_self_draft_leaves_the_float_models_output_as_it_was(
    standalone: tuple[Engine, Engine],
) -> None:
    plain, spec = standalone
    assert spec.draft_model is not None
    for params in (
        {"temperature": 0, "max_new_tokens": 32},
        {"temperature": 0.7, "top_k": 40, "sampling_seed": 11, "max_new_tokens": 32},
    ):
        want = plain.generate(PROMPTS, params)
        got = spec.generate(PROMPTS, params)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    meta = [g["meta_info"] for g in got]
    # Q4_1's greedy drafts are the float model's choice most of the time.
    assert (
        sum(m["spec_accept_token_num"] for m in meta)
        > sum(m["spec_draft_token_num"] for m in meta) // 2
    )
    spec.flush_cache()
    for pool in (spec.runner.pool, spec.draft_model.pool):
        assert pool.free_pages == pool.num_pages
