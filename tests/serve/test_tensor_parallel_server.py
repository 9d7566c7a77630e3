"""A tensor-parallel artefact behind the OpenAI server: rank 0 serves, rank 1 is its own
process, and nothing is left running after the server stops."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import openai
from serve_helpers import API_KEY, start_server, stop_server

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model

PROMPT = list(range(3, 43))
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _ranks_of(art: Path) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"kiln.runtime.parallel {art}"], capture_output=True, text=True
    )
    return [int(x) for x in found.stdout.split()]


def test_a_tp2_server_answers_as_tp1_and_leaves_no_rank_behind(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = checkpoint("llama", num_kv_heads=4)
    arts = {tp: tmp_path / f"tp{tp}" for tp in (1, 2)}
    for tp, art in arts.items():
        compile_model(ServerArgs(model_path=str(ckpt), dtype="float32", tp_size=tp), art)
    [want] = Engine(arts[1], max_total_tokens=1024).generate(
        input_ids=[PROMPT], sampling_params=GREEDY
    )
    server = start_server(arts[2], tmp_path / "server.log", "--api-key", API_KEY)
    try:
        assert len(_ranks_of(arts[2])) == 1  # rank 1's process; rank 0 is the server
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        reply = client.completions.create(model="tp2", prompt=PROMPT, max_tokens=16, temperature=0)
        assert reply.choices[0].text == want["text"]
    finally:
        stop_server(server)
    assert _ranks_of(arts[2]) == []
