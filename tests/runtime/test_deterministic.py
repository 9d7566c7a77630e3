"""--enable-deterministic-inference: a request's greedy tokens and logprobs are bitwise the
same alone, after a prefix-cache hit, beside other requests of other lengths, and with its
prompt cut into other chunks. The same checks on the artefact without the flag find a
difference (its prompt rows are scored as runs, a lone long row's keys split over the
threads), so they can fail."""

from __future__ import annotations

import pytest

from kiln import Engine
from kiln.args import ArgError, ServerArgs
from kiln.compiler.compile import compile_model

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = list(range(5, 205))  # 200 tokens: a lone row's keys split when not deterministic
OTHERS = [list(range(7, 7 + n)) for n in (3, 40, 90, 150)]


def logprobs(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def scenarios(art, **chunked) -> list[list[float]]:
    """The prompt's logprobs: alone; again (its prefix from the cache); after the others,
    with them in the step; alone on an engine that cuts prompts into 64-token chunks."""
    engine = Engine(art, max_total_tokens=4096)
    first = logprobs(engine, [PROMPT])[0]
    again = logprobs(engine, [PROMPT])[0]
    engine.flush_cache()
    mixed = logprobs(engine, [*OTHERS, PROMPT])[-1]
    small = Engine(art, max_total_tokens=4096, chunked_prefill_size=64)
    return [first, again, mixed, logprobs(small, [PROMPT])[0]]


# fp32 weights, and 4-bit ones with float activations (the kernel whose 1-row, few-row and
# prompt tiles round differently: each row its own call under the flag)
@pytest.mark.parametrize("scheme", [{}, {"torchao_config": "int4wo-32"}], ids=["f32", "int4"])
def test_a_requests_logprobs_do_not_depend_on_its_batch(artefact, scheme) -> None:
    flag = {**scheme, "enable_deterministic_inference": True}
    det = scenarios(artefact("llama", compile_args=flag))
    assert all(run == det[0] for run in det[1:]), det
    loose = scenarios(artefact("llama", compile_args=scheme))
    assert any(run != loose[0] for run in loose[1:])  # what the flag changes
    assert max(abs(a - b) for run in loose for a, b in zip(run, det[0], strict=True)) < 1e-4


def test_deterministic_needs_a_cpu_target(checkpoint) -> None:
    args = ServerArgs(
        model_path=str(checkpoint("llama")),
        device="cuda",
        target_isa="sm_90",
        enable_deterministic_inference=True,
    )
    with pytest.raises(ArgError, match="--enable-deterministic-inference: batch-invariant"):
        compile_model(args)
