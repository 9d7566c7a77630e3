"""`kiln serve` on a GPU: a CUDA artefact (decode replayed from CUDA graphs) served over
loopback to the official openai client, its answers against the same checkpoint on the
CPU. Skipped where torch sees no CUDA device; benchmarks/gpu_check.sh runs it where there
is one (the engine and the graphs themselves: tests/runtime/test_cuda.py)."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from serve_helpers import API_KEY, generated_tokens, stream_completions

from kiln import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
CUDA = {"device": "cuda", "cuda_graph_max_bs": 8}


@pytest.fixture(scope="module")
def server(artefact, launch):
    return launch(
        artefact("llama", compile_args=CUDA),
        "--api-key",
        API_KEY,
        "--enable-metrics",
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "tiny",
        # compact JSON: the tiny random model would fill its tokens with whitespace
        "--constrained-json-disable-any-whitespace",
    )


@pytest.fixture(scope="module")
def on_cpu(artefact) -> Engine:
    return Engine(artefact("llama", compile_args={"device": "cpu"}), max_total_tokens=4096)


def test_concurrent_streams_on_the_gpu_answer_as_the_cpu(server, on_cpu) -> None:
    """24 streams at once (decode batches past the largest graph, 8, and between its
    buckets), each stream's text the CPU's greedy text; the server counts every token."""
    prompts = [f"Request number {i}: hello" for i in range(24)]
    expected = [r["text"] for r in on_cpu.generate(prompts, GREEDY)]
    before = generated_tokens(server)
    assert stream_completions(server, prompts, MAX_TOKENS) == expected
    assert generated_tokens(server) - before == len(prompts) * MAX_TOKENS


def test_sampling_and_a_json_schema_over_http_on_the_gpu(server) -> None:
    """n samples with a seed come back the same twice; a JSON schema's grammar masks the
    GPU's logits: every answer closes and holds the schema's keys and ranges."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    kw = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "n": 3}
    first = client.completions.create(seed=11, **kw)
    again = client.completions.create(seed=11, **kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["red", "green", "blue"]},
        },
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    for temperature in (0.0, 1.0):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a number"}],
            max_tokens=96,
            temperature=temperature,
            response_format=fmt,
        )
        assert out.choices[0].finish_reason == "stop", out
        thing = json.loads(out.choices[0].message.content)
        assert sorted(thing) == ["n", "tag"] and 0 <= thing["n"] <= 999, thing
