"""--stream-output (SGLang's): /generate streams disjoint segments, each chunk only its
new text, output_ids and logprobs, which add up to the whole answer."""

from __future__ import annotations

import json

import httpx


def test_chunks_are_disjoint_and_add_up(artefact, launch) -> None:
    server = launch(artefact("llama"), "--stream-output", "--stream-interval", "3")
    params = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0}
    body = {"text": "Hello", "sampling_params": params, "return_logprob": True}
    whole = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    chunks = []
    with httpx.stream(
        "POST", server.url + "/generate", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert [len(c["output_ids"]) for c in chunks] == [3, 3, 3, 1]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    logprobs = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [t for _, t, _ in logprobs] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 10
