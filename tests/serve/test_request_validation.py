"""Request bodies as careless clients send them (issue 23, items 6-9): a 0 is a 0, nested
fields are never silently ignored, every accepted value is safe, and errors name the field."""

from __future__ import annotations

import json

import pytest
from serve_helpers import API_KEY

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(artefact, launch):
    return launch(artefact("llama"), "--api-key", API_KEY, "--max-total-tokens", "4096")


def sse(text: str) -> list[dict]:
    return [
        json.loads(x[6:])
        for x in text.splitlines()
        if x.startswith("data: ") and x != "data: [DONE]"
    ]


# -- item 6: zero is not "not given" ------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0, "ignore_eos": True}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0, "ignore_eos": True}),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0, "max_tokens": 50}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "ignore_eos": True}),
    ],
)
def test_zero_max_tokens_generates_nothing(server, path, body) -> None:
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": "hi", "best_of": 0}, "best_of must be in [n, 20], got 0"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n must be in [1, 128], got 0"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n must be in [1, 128], got 0"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens: Input should be"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ],
)
def test_zero_and_negative_counts_that_make_no_sense_are_a_400(server, path, body, message) -> None:
    r = server.post(path, json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text


def test_completions_n_above_best_ofs_limit_needs_no_best_of(server) -> None:
    """docs/serving.md: n is 1..128 on both OpenAI routes; best_of, when given, n..20."""
    r = server.post("/v1/completions", json={"prompt": "hi", "n": 21, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 21, r.text
    r = server.post("/v1/completions", json={"prompt": "hi", "n": 21, "best_of": 21})
    assert r.status_code == 400 and "best_of must be in [n, 20]" in r.json()["message"]


# -- item 7: fields inside nested objects -------------------------------------------------------
def test_continuous_usage_stats_puts_the_usage_in_every_chunk(server) -> None:
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
        body = {
            **base,
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True},
        }
        chunks = sse(server.post(path, json=body).text)
        assert all("usage" in c for c in chunks), chunks
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5
        assert chunks[-1]["choices"] == []  # the include_usage chunk still ends the stream


@pytest.mark.parametrize(
    "path, body, message",
    [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
                ]
            },
            "messages.1.tool_calls.0.function",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}", "x": 1},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.x",
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs: only allowed with"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream_options": {"include_usage": True}},
            "stream_options: only allowed with stream: true",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}},
            "stream_options: only allowed with stream: true",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            "stream_options.x: unknown field",
        ),
    ],
)
def test_nested_fields_are_refused_not_ignored(server, path, body, message) -> None:
    r = server.post(path, json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text


# -- item 8: every value the validator accepts runs -------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1e-38},
        {"repetition_penalty": 5e-324},
        {"repetition_penalty": 1e-38, "temperature": 1e-6},
        {"repetition_penalty": 1e-38, "temperature": 0.7, "top_p": 1e-30},
        {"frequency_penalty": -2, "presence_penalty": -2, "temperature": 1e-6},
    ],
)
def test_extreme_accepted_sampling_values_do_not_fail(server, params) -> None:
    body = {"text": "hello hello", "sampling_params": {"max_new_tokens": 8, **params}}
    r = server.post("/generate", json={**body, "return_logprob": True, "top_logprobs_num": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) >= 1


# -- item 9: errors name the field -----------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed must be an integer in"),
        ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed must be an integer in"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"²": 1}}, "logit_bias: keys must be"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias: keys"),
        ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": 2**70}}, "seed must be"),
    ],
)
def test_out_of_range_values_name_their_field(server, path, body, message) -> None:
    r = server.post(path, json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text


def test_any_64_bit_seed_is_a_seed(server) -> None:
    for seed in (2**64 - 1, -(2**63), 0):
        body = {"prompt": "hi", "seed": seed, "n": 2, "max_tokens": 2, "temperature": 1}
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
