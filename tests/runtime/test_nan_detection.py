"""--enable-nan-detection and --crash-on-nan: a checkpoint whose lm_head row for one token
is NaN. Without detection that token wins every argmax (NaN counts as the maximum); with
it the row reads -1e5 and the text is the clean model's; with --crash-on-nan the request
fails and the engine asks its server to stop."""

from __future__ import annotations

import logging
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def clean_tokens(artefact) -> list[int]:
    return Engine(artefact("llama"), max_total_tokens=1024).generate(PROMPT, GREEDY)["output_ids"]


@pytest.fixture(scope="module")
def nan_token(clean_tokens) -> int:
    return next(t for t in range(300, 384) if t not in clean_tokens)


@pytest.fixture(scope="module")
def nan_artefact(checkpoint, tmp_path_factory, nan_token):
    ckpt = tmp_path_factory.mktemp("nan") / "llama"
    shutil.copytree(checkpoint("llama"), ckpt)
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"][nan_token] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    art = ckpt.parent / "art"
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32"), art)
    return art


def test_nan_logits_are_read_as_minus_1e5_and_logged(
    nan_artefact, nan_token, clean_tokens, caplog
) -> None:
    plain = Engine(nan_artefact, max_total_tokens=1024).generate(PROMPT, GREEDY)
    assert plain["output_ids"] == [nan_token] * 8  # the hazard the flag is for
    engine = Engine(nan_artefact, max_total_tokens=1024, enable_nan_detection=True)
    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        out = engine.generate(PROMPT, {**GREEDY, "temperature": 0.7, "top_k": 5})
        greedy = engine.generate(PROMPT, GREEDY)
    assert greedy["output_ids"] == clean_tokens
    assert nan_token not in out["output_ids"]  # a sampled row never draws it either
    assert "NaN in the logits of 1 of 1 rows" in caplog.text
    assert "(--enable-nan-detection)" in caplog.text


def test_crash_on_nan_fails_the_request_and_stops_the_server(nan_artefact) -> None:
    engine = Engine(nan_artefact, max_total_tokens=1024, crash_on_nan="true")
    stops: list[str] = []
    engine.on_fatal(stops.append)
    out = engine.generate(PROMPT, GREEDY)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 503
    assert "(--crash-on-nan)" in reason["message"] and stops == [reason["message"]]
    assert out["meta_info"]["completion_tokens"] == 0
    with pytest.raises(ArgError, match="--crash-on-nan: true or false, got 'maybe'"):
        Engine(nan_artefact, crash_on_nan="maybe")
