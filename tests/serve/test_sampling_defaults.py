"""Where an unset sampling parameter comes from (SGLang's --sampling-defaults and
--preferred-sampling-params): the checkpoint's generation_config.json, recorded at compile
time, for the OpenAI routes; the operator's JSON for every generation route; the
request's own fields above both."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from serve_helpers import API_KEY

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.serve.context import _model_sampling, _preferred_sampling

PROMPT = [1, 5, 9]


@pytest.fixture(scope="module")
def recommended(checkpoint, tmp_path_factory):
    """The tiny llama with a generation_config.json that recommends greedy decoding (and
    states values kiln takes, converts or skips)."""
    root = tmp_path_factory.mktemp("gen-config")
    ckpt = root / "llama"
    shutil.copytree(checkpoint("llama"), ckpt)
    config = {
        "temperature": 0.0,
        "top_k": 0,  # HF: no top-k, kiln's -1
        "top_p": 0.9,
        "repetition_penalty": True,  # not a number: skipped
        "do_sample": True,  # not one of the five: ignored, as SGLang does
        "max_new_tokens": 3,  # likewise
    }
    (ckpt / "generation_config.json").write_text(json.dumps(config))
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32"), root / "art")
    return root / "art"


def test_the_artefact_records_what_generation_config_recommends(recommended) -> None:
    engine = Engine(recommended, max_total_tokens=256)
    assert engine.art.spec.sampling_defaults == {"temperature": 0.0, "top_k": -1, "top_p": 0.9}
    assert _model_sampling(engine, "openai") == {}
    assert _model_sampling(engine, "model") == engine.art.spec.sampling_defaults
    assert _preferred_sampling(None) is None
    for bad, message in (
        ("{temp", "not valid JSON"),
        ("[1]", "a JSON object"),
        ('{"top_p": 2}', "top_p must be in"),
        ('{"tempreature": 1}', "tempreature"),
    ):
        with pytest.raises(ValueError, match=f"--preferred-sampling-params: .*{message}"):
            _preferred_sampling(bad)


def test_unset_fields_come_from_the_model_then_the_operator(recommended, launch) -> None:
    """OpenAI routes without a temperature decode greedily (the file's 0); /generate does
    not take the file's values (SGLang's native defaults: temperature 1) but takes the
    operator's max_new_tokens; a request's own fields win over both."""
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    greedy = Engine(recommended, max_total_tokens=256).generate(
        input_ids=PROMPT, sampling_params=params
    )
    preferred = {"max_new_tokens": 4, "ignore_eos": True}
    server = launch(
        recommended,
        "--api-key",
        API_KEY,
        "--served-model-name",
        "tiny",
        "--preferred-sampling-params",
        json.dumps(preferred),
    )
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "seed": 5}
    out = server.post("/v1/completions", json=body).json()["choices"][0]
    assert out["text"] == greedy["text"]
    sampled = server.post("/v1/completions", json={**body, "temperature": 1.0}).json()
    assert sampled["choices"][0]["text"] != greedy["text"]
    native = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"seed": 5}})
    meta = native.json()["meta_info"]
    assert meta["completion_tokens"] == 4  # the operator's max_new_tokens, ignore_eos
    assert native.json()["output_ids"] != greedy["output_ids"][:4]  # temperature 1
    mine = {"seed": 5, "max_new_tokens": 2, "temperature": 0}
    own = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": mine}).json()
    assert own["output_ids"] == greedy["output_ids"][:2]
    assert server.get("/get_model_info").json()["preferred_sampling_params"] == preferred
    # the server logs SGLang's batch lines (runtime/batch_log.py) at its default level
    log = server.log.read_text()
    assert re.search(r"Prefill batch\. #new-seq: 1, #new-token: \d+, #cached-token: \d+", log)
    assert "sampling defaults from generation_config.json" in log
