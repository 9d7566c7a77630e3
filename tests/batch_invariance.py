"""--enable-deterministic-inference's checks, shared by the CPU's tests and the GPU's: one
prompt's greedy logprobs in each setting a batch-dependent kernel would change."""

from __future__ import annotations

from pathlib import Path

from kiln import Engine

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = list(range(5, 205))  # 200 tokens: a lone row's keys split when not deterministic
OTHERS = [list(range(7, 7 + n)) for n in (3, 40, 90, 150)]


def logprobs(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def scenarios(art: Path) -> list[list[float]]:
    """The prompt's logprobs: alone; again (its prefix from the cache); after the others,
    with them in the step; alone on an engine that cuts prompts into 64-token chunks.
    Two kernel threads, named: a lone row's keys split over them only with two or more, and
    the count is the process's, left at one by any earlier test in this worker that set it."""
    engine = Engine(art, max_total_tokens=4096, threads=2)
    first = logprobs(engine, [PROMPT])[0]
    again = logprobs(engine, [PROMPT])[0]
    engine.flush_cache()
    mixed = logprobs(engine, [*OTHERS, PROMPT])[-1]
    small = Engine(art, max_total_tokens=4096, chunked_prefill_size=64, threads=2)
    return [first, again, mixed, logprobs(small, [PROMPT])[0]]
