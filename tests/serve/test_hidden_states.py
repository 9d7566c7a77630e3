"""SGLang's return_hidden_states (an artefact compiled with --enable-return-hidden-states):
meta_info hidden_states holds the prompt's final hidden states as one list of rows, then
one row for each generated token but the last (the tokens fed after the prompt), checked
against transformers' last hidden state over the same tokens; served on /generate and as
each OpenAI choice's `hidden_states` (the last row). Requests that do not ask get none,
and asking an artefact without the flag is a clear error."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from serve_helpers import API_KEY

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model
from kiln.runtime.engine import RequestError
from kiln.runtime.native_step import NativeStep

PROMPTS = [[1, 5, 9], list(range(3, 30))]
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
FLAG = {"enable_return_hidden_states": True}


@pytest.fixture(scope="module")
def art(artefact):
    return artefact("llama", compile_args=FLAG)


@pytest.fixture(scope="module")
def engine(art) -> Engine:
    return Engine(art, max_total_tokens=1024)


def transformers_hidden(checkpoint, seq: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint("llama"), torch_dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
    return out.hidden_states[-1][0].numpy()


def rows_of(hidden: list) -> np.ndarray:
    """meta_info hidden_states as one [tokens, hidden] array (the prompt's rows first)."""
    return np.array([*hidden[0], *hidden[1:]], dtype=np.float32)


def test_hidden_states_are_transformers_last_hidden_state(engine, artefact, checkpoint):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_hidden_states=True)
    plain = Engine(artefact("llama"), max_total_tokens=1024)
    want_ids = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    # the step lowered to C returns the hidden states as its second output
    assert isinstance(engine.runner.decode, NativeStep) and engine.runner.decode.hidden_width
    for prompt, out, ids in zip(PROMPTS, outs, want_ids, strict=True):
        assert out["output_ids"] == ids  # the same tokens as without the flag
        hidden = out["meta_info"]["hidden_states"]
        assert len(hidden) == GREEDY["max_new_tokens"]  # SGLang's shape
        assert len(hidden[0]) == len(prompt) and isinstance(hidden[1][0], float)
        want = transformers_hidden(checkpoint, prompt + out["output_ids"][:-1])
        np.testing.assert_allclose(rows_of(hidden), want, atol=1e-4, rtol=0)


def test_cached_prefixes_chunks_and_requests_that_do_not_ask(art, engine) -> None:
    """A prompt asked for twice (the second could take the first's cached prefix) and on
    an engine that prefills in 8-token chunks gives the same rows; a request beside it
    that does not ask gets none."""
    first = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, return_hidden_states=True)
    again = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, return_hidden_states=True)
    chunked = Engine(art, max_total_tokens=1024, chunked_prefill_size=8).generate(
        input_ids=PROMPTS[1], sampling_params=GREEDY, return_hidden_states=True
    )
    want = rows_of(first["meta_info"]["hidden_states"])
    for other in (again, chunked):
        np.testing.assert_allclose(rows_of(other["meta_info"]["hidden_states"]), want, atol=1e-5)
    mixed = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert all("hidden_states" not in o["meta_info"] for o in mixed)


def test_asking_without_the_flag_and_flags_it_cannot_join(artefact, checkpoint) -> None:
    plain = Engine(artefact("llama"), max_total_tokens=1024)
    with pytest.raises(RequestError, match="--enable-return-hidden-states"):
        plain.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_hidden_states=True)
    for clash, flags in (
        ("--is-embedding", {"is_embedding": True}),
        ("--speculative-algorithm", {"speculative_algorithm": "NGRAM"}),
    ):
        args = ServerArgs(model_path=str(checkpoint("llama")), **FLAG, **flags)
        with pytest.raises(ArgError, match=f"--enable-return-hidden-states: not with {clash}"):
            compile_model(args)


def test_the_server_returns_them(art, engine, launch) -> None:
    server = launch(art, "--served-model-name", "tiny", "--api-key", API_KEY)
    want = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, return_hidden_states=True)
    body = {"input_ids": PROMPTS[1], "sampling_params": GREEDY, "return_hidden_states": True}
    got = server.post("/generate", json=body).json()
    np.testing.assert_allclose(
        rows_of(got["meta_info"]["hidden_states"]),
        rows_of(want["meta_info"]["hidden_states"]),
        atol=1e-5,
    )
    streamed = []
    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed.append(httpx.Response(200, content=line[6:]).json())
    assert "hidden_states" in streamed[-1]["meta_info"]  # the whole list, in the last chunk
    assert len(streamed[-1]["meta_info"]["hidden_states"]) == GREEDY["max_new_tokens"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    out = client.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "return_hidden_states": True},
    )
    last = want["meta_info"]["hidden_states"][-1]  # SGLang's: the last row
    np.testing.assert_allclose(out.choices[0].model_extra["hidden_states"], last, atol=1e-5)
    bare = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2)
    assert "hidden_states" not in (bare.choices[0].model_extra or {})
