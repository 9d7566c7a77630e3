"""Engine behaviour beyond parity: stopping, seeds, memory pressure, errors."""

from __future__ import annotations

import logging

import pytest

from kiln import Engine
from kiln.args import ArgError

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = [[1, 5, 9], list(range(3, 30)), [7, 8, 9, 10, 11], [2, 2]]


@pytest.fixture(scope="module")
def engine(artefact) -> Engine:
    return Engine(artefact("llama"), max_total_tokens=1024)


def test_retraction_under_memory_pressure_loses_nothing(engine, artefact) -> None:
    expected = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    # 64 slots cannot hold all four sequences at full length: requests are retracted and
    # re-prefilled, and still finish with the same tokens.
    small = Engine(artefact("llama"), max_total_tokens=64)
    got = small.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    # Idle: every page is free or held by the prefix cache (evictable), none by a request.
    pool = small.runner.pool
    assert pool.free_pages + small.scheduler.cached_pages == pool.num_pages


def test_stop_token_ids_and_eos(engine) -> None:
    free = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    stop = free["output_ids"][5]
    out = engine.generate(
        input_ids=PROMPTS[1], sampling_params={**GREEDY, "stop_token_ids": [stop]}
    )
    first = free["output_ids"].index(stop)
    assert out["output_ids"] == free["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # The same token as EOS stops the request unless ignore_eos.
    engine._eos.add(stop)
    try:
        out = engine.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "ignore_eos": False})
        assert out["output_ids"][-1] == stop and len(out["output_ids"]) == first + 1
    finally:
        engine._eos.discard(stop)


def test_seeded_sampling_and_n(engine) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 7, "ignore_eos": True}
    a = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    b = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    assert a["output_ids"] == b["output_ids"]
    many = engine.generate(input_ids=[PROMPTS[0]], sampling_params={**params, "n": 3})
    assert len(many) == 3 and len({tuple(m["output_ids"]) for m in many}) > 1


def test_mixed_sampling_params_in_one_batch(engine) -> None:
    alone = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
    outs = engine.generate(
        input_ids=[PROMPTS[2], PROMPTS[0]],
        sampling_params=[
            GREEDY,
            {
                "temperature": 0.9,
                "top_p": 0.9,
                "top_k": 20,
                "min_p": 0.05,
                "seed": 1,
                "max_new_tokens": 5,
            },
        ],
    )
    assert outs[0]["output_ids"] == alone["output_ids"]
    assert outs[1]["meta_info"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": []}, "the prompt is empty"),
        ({"input_ids": [1, 10_000]}, r"outside the vocabulary \[0, 384\)"),
        (
            {"input_ids": list(range(1, 300))},
            "the prompt has 299 tokens; the context length is 256",
        ),
        ({"prompt": "hi", "input_ids": [1]}, "exactly one of"),
    ],
)
def test_bad_requests_are_clear_errors(engine, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(sampling_params=GREEDY, **kwargs)
    # and the engine keeps working
    assert engine.generate(input_ids=[1, 2], sampling_params=GREEDY)["output_ids"]


def test_compile_time_flags_must_agree_with_the_artefact(artefact) -> None:
    art = artefact("llama")
    with pytest.raises(
        ArgError,
        match=r"--page-size: 4 disagrees with the artefact, compiled "
        r"with 1 \(compile-time argument",
    ):
        Engine(art, page_size=4)
    with pytest.raises(ArgError, match="--dtype: 'bfloat16' disagrees"):
        Engine(art, dtype="bfloat16")
    # The same values (in any spelling) are accepted, so a whole command line carries over.
    Engine(art, page_size=1, dtype="float", device="cpu", max_total_tokens=64)


def test_stop_strings_trim_the_text_and_report_the_match(engine) -> None:
    free = engine.generate("Hello", {**GREEDY, "max_new_tokens": 16})
    text = free["text"]
    assert len(text) > 6
    stop = text[3:6]
    out = engine.generate("Hello", {**GREEDY, "max_new_tokens": 16, "stop": [stop, "zzzz"]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate(
        "Hello", {**GREEDY, "max_new_tokens": 16, "stop": stop, "no_stop_trim": True}
    )
    assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_logprobs_in_meta_info(engine) -> None:
    out = engine.generate(
        input_ids=PROMPTS[0],
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        top_logprobs_num=3,
    )
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(text is None for *_, text in lps)  # SGLang's entries: (logprob, id, text)
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 4 and all(len(t) == 3 for t in tops)
    # Greedy: the chosen token is the most likely one.
    assert all(top[0][1] == tok for top, tok in zip(tops, out["output_ids"], strict=True))


def test_abort_returns_memory_to_the_pool(engine) -> None:
    pool = engine.runner.pool
    engine.flush_cache()
    idle = pool.free_pages
    reqs = [engine.make_request(list(p), engine_params(), i) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert pool.free_pages < idle
    for r in reqs:
        out = engine.abort(r.rid)
        assert out is not None and out.finished and out.finish_reason["type"] == "abort"
    assert engine.abort(reqs[0].rid) is None  # already gone
    assert pool.free_pages + engine.scheduler.cached_pages == idle
    assert not engine.has_work


def engine_params():
    from kiln.runtime.sampling_params import SamplingParams

    return SamplingParams(**GREEDY)


def test_context_length_flag(artefact) -> None:
    short = Engine(artefact("llama"), context_length=32, max_total_tokens=256)
    with pytest.raises(ValueError, match="the prompt has 40 tokens; the context length is 32"):
        short.generate(input_ids=list(range(1, 41)), sampling_params=GREEDY)
    out = short.generate(
        input_ids=list(range(1, 21)), sampling_params={**GREEDY, "max_new_tokens": 50}
    )
    assert out["meta_info"]["completion_tokens"] == 12  # stopped at the context
    with pytest.raises(ArgError, match="--context-length: 1000 is longer than the model's 256"):
        Engine(artefact("llama"), context_length=1000)


def test_a_request_that_breaks_the_step_is_the_only_one_lost(engine) -> None:
    """If a step still fails (here: a parameter the edge would have refused, forced in
    afterwards), the batch is retried in halves and only the culprit is stopped."""
    from kiln.runtime.sampling_params import SamplingParams

    expected = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    sampled = SamplingParams.from_dict({**GREEDY, "temperature": 1.0})
    bad = engine.make_request(list(PROMPTS[2]), sampled)
    object.__setattr__(bad.params, "top_k", 2.5)  # torch.topk refuses a float k
    good = [engine.make_request(list(p), SamplingParams.from_dict(GREEDY)) for p in PROMPTS]
    for req in [*good[:2], bad, *good[2:]]:
        engine.add_request(req)
    while any(not r.finished for r in [*good, bad]):
        engine.step()
    assert bad.finish_reason["type"] == "abort"
    assert "internal error" in bad.finish_reason["message"]
    assert [r.output_ids for r in good] == [e["output_ids"] for e in expected]
    assert all(r.finish_reason["type"] == "length" for r in good)


def test_min_new_tokens_holds_back_stop_tokens(engine) -> None:
    free = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    first = free["output_ids"][0]
    params = {**GREEDY, "stop_token_ids": [first], "max_new_tokens": 6}
    stopped = engine.generate(input_ids=PROMPTS[1], sampling_params=params)
    assert stopped["output_ids"] == [first]
    held = engine.generate(input_ids=PROMPTS[1], sampling_params={**params, "min_new_tokens": 3})
    assert first not in held["output_ids"][:3] and len(held["output_ids"]) >= 3


def test_tiny_temperatures_are_greedy(engine) -> None:
    greedy = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    tiny = engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "temperature": 1e-45})
    assert tiny["output_ids"] == greedy["output_ids"]


def test_a_plain_tokenizer_is_served_without_transformers(artefact) -> None:
    """The test artefact's tokenizer (the plain fast class) is read by `tokenizers` alone: an
    engine in a fresh process never imports transformers (0.9 s of a start on a slow core)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from kiln.runtime.engine import Engine\n"
        "from kiln.runtime.tokenizer import FastTokenizer\n"
        f"e = Engine({str(artefact('llama'))!r})\n"
        "assert isinstance(e.tokenizer, FastTokenizer), type(e.tokenizer)\n"
        "out = e.generate(input_ids=[1, 5, 9], sampling_params={'max_new_tokens': 2})\n"
        "assert len(out['output_ids']) == 2\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("collect", [True, False])
def test_the_startup_heap_is_frozen_and_later_garbage_still_collected(collect: bool) -> None:
    """A serving process exempts its startup objects from full collections (each walked
    them all holding the GIL: a stall of /health and of the step); cycles made after
    that are still freed. Without `collect` (a clean `kiln serve` start) the startup's own
    unreachable cycles are frozen with it rather than freed first."""
    import gc
    import weakref

    from kiln.runtime.model_runner import freeze_startup_heap

    class Node:
        pass

    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between here and the freeze
    startup_garbage = Node()
    startup_garbage.me = startup_garbage  # type: ignore[attr-defined]
    earlier = weakref.ref(startup_garbage)
    del startup_garbage
    try:
        count = freeze_startup_heap(collect=collect)
        # Other threads of the session (earlier tests' servers) may free a frozen object
        # between the two reads: CI once saw 744202 then 744200.
        assert count > 1000 and 0 <= count - gc.get_freeze_count() < 100
        assert (earlier() is None) == collect
        assert earlier() is None or not any(o is earlier() for o in gc.get_objects())
        later = Node()
        later.me = later  # type: ignore[attr-defined]
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
        assert (earlier() is None) == collect  # frozen: no collection walks it
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_named_tokens_logprobs_are_transformers(engine, checkpoint) -> None:
    """SGLang's token_ids_logprob: at every generated position and every scored prompt
    position, the named tokens' logprobs, transformers' log-softmax of the same checkpoint;
    with return_text_in_logprobs each entry carries its token's text. Out-of-vocabulary
    ids, too many ids, and ids without logprobs are refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.runtime.engine import MAX_LOGPROB_IDS, RequestError
    from kiln.runtime.sampling_params import SamplingParams

    prompt, ids = list(range(3, 15)), [5, 300, 5, 0]
    out = engine.generate(
        input_ids=prompt,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=0,
        token_ids_logprob=ids,
        return_text_in_logprobs=True,
    )
    hf = AutoModelForCausalLM.from_pretrained(checkpoint("llama"), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    want = torch.log_softmax(logits, -1)[:, ids]
    meta = out["meta_info"]
    made, scored = meta["output_token_ids_logprobs"], meta["input_token_ids_logprobs"]
    assert len(made) == 4 and len(scored) == len(prompt) and scored[0] is None
    rows = [want[len(prompt) - 1 + j] for j in range(4)] + [want[i - 1] for i in range(1, 12)]
    for entries, row in zip(made + scored[1:], rows, strict=True):
        assert [t for _, t, _ in entries] == ids
        assert [v for v, _, _ in entries] == pytest.approx(row.tolist(), abs=1e-4)
        assert [x for *_, x in entries] == [engine.tokenizer.decode([t]) for t in ids]
    assert meta["output_token_logprobs"][0][2] == engine.tokenizer.decode(out["output_ids"][:1])
    plain = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    assert "output_token_ids_logprobs" not in plain["meta_info"]
    vocab = engine.art.spec.vocab_size
    for bad, message in (
        ((vocab,), "outside the vocabulary"),
        ((-1,), "outside the vocabulary"),
        (tuple(range(MAX_LOGPROB_IDS + 1)), f"at most {MAX_LOGPROB_IDS}"),
    ):
        with pytest.raises(RequestError, match=message):
            engine.make_request(prompt, SamplingParams(), top_logprobs=0, logprob_ids=bad)
    with pytest.raises(RequestError, match="needs return_logprob"):
        engine.make_request(prompt, SamplingParams(), logprob_ids=(1,))


def test_prompt_logprobs_are_transformers_and_survive_chunks_and_the_cache(
    engine, artefact, checkpoint, monkeypatch
) -> None:
    """SGLang's logprob_start_len: the prompt's logprobs (each token's after the first,
    with the top k) are transformers' log-softmax of the same checkpoint's logits; the same
    whether the prompt is prefilled whole or in chunks of 5 tokens, and when the prefix
    cache holds the prompt (a scorer's prompt is computed whole); max_new_tokens 0 only
    scores, also when a chunk ends one token before the prompt's end, and when a scored
    prompt is cut into steps of its own (SCORED_CHUNK)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.runtime import scheduler

    prompt = list(range(3, 30))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint("llama"), torch_dtype=torch.float32)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    params = {**GREEDY, "max_new_tokens": 3}
    engine.generate(input_ids=prompt, sampling_params=params)  # the prefix cache holds it now
    chunked = Engine(artefact("llama"), max_total_tokens=1024, chunked_prefill_size=5)
    whole: list = []
    for eng in (engine, chunked):
        out = eng.generate(
            input_ids=prompt,
            sampling_params=params,
            return_logprob=True,
            top_logprobs_num=2,
            logprob_start_len=0,
        )
        meta = out["meta_info"]
        tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [t for _, t, _ in tokens] == prompt and tokens[0][0] is None and tops[0] is None
        got = torch.tensor([v for v, _, _ in tokens[1:]])
        expect = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(got, expect, atol=1e-4), (got - expect).abs().max()
        best = want[:-1].topk(2, dim=-1)
        assert [[t for _, t, _ in top] for top in tops[1:]] == best.indices.tolist()
        assert len(out["output_ids"]) == 3 and len(meta["output_token_logprobs"]) == 3
        whole = whole or tokens
    late = engine.generate(
        input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=20
    )["meta_info"]
    assert late["input_token_logprobs"] == whole[20:]
    only = engine.generate(
        input_ids=prompt,
        sampling_params={**params, "max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert only["output_ids"] == [] and only["meta_info"]["input_token_logprobs"] == whole
    assert only["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    edge = chunked.generate(  # chunks of 5 end at 25 of 26 tokens
        input_ids=prompt[:26],
        sampling_params={**params, "max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert edge["output_ids"] == [] and len(edge["meta_info"]["input_token_logprobs"]) == 26
    monkeypatch.setattr(scheduler, "SCORED_CHUNK", 4)
    cut = engine.generate(
        input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0
    )["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in cut] == prompt
    assert [v for v, *_ in cut[1:]] == pytest.approx([v for v, *_ in whole[1:]], abs=1e-5)


def test_sglangs_batch_log_lines(artefact, caplog) -> None:
    """A 'Prefill batch.' line for each prefill (prompt tokens fed and those the prefix
    cache served) and a 'Decode batch.' line every --decode-log-interval decode steps, in
    SGLang's wording, with numbers that add up."""
    import logging
    import re

    engine = Engine(artefact("llama"), max_total_tokens=512, decode_log_interval=3)
    prompts = [list(range(3, 20)), list(range(3, 12))]
    with caplog.at_level(logging.INFO, logger="kiln.runtime"):
        engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "max_new_tokens": 1})
        caplog.clear()
        engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 7})
    lines = [r.getMessage() for r in caplog.records]
    prefill = [m for m in lines if m.startswith("Prefill batch.")]
    decode = [m for m in lines if m.startswith("Decode batch.")]
    # the second prompt is a prefix of the first, whose pages the cache holds
    fields = dict(re.findall(r"#([a-z-]+): ([0-9.]+)", prefill[0]))
    assert len(prefill) == 1 and fields["new-seq"] == "2", prefill
    assert int(fields["new-token"]) + int(fields["cached-token"]) == 17 + 9
    assert int(fields["cached-token"]) > 0
    assert len(decode) == 2, decode  # 6 decode steps after the prefill's first tokens
    first = dict(re.findall(r"#([a-z-]+): ([0-9.]+)", decode[0]))
    assert first["running-req"] == "2" and first["token"] == str(17 + 3 + 9 + 3)
    assert float(decode[0].split("gen throughput (token/s): ")[1].split(",")[0]) > 0


def test_prefill_max_requests_caps_a_prefill_batch(artefact) -> None:
    """--prefill-max-requests 2: five waiting prompts are prefilled two, two, one at a
    time, and give what an uncapped engine gives."""
    from kiln.runtime.sampling_params import SamplingParams

    capped = Engine(artefact("llama"), max_total_tokens=1024, prefill_max_requests=2)
    reqs = [capped.make_request(p, SamplingParams(**GREEDY)) for p in [*PROMPTS, [9, 9, 9]]]
    for r in reqs:
        capped.add_request(r)
    firsts = [len(capped.step()) for _ in range(3)]
    assert firsts == [2, 2, 1]  # each prefill step samples its prompts' first tokens
    while capped.has_work:
        capped.step()
    plain = Engine(artefact("llama"), max_total_tokens=1024)
    want = plain.generate(input_ids=[*PROMPTS, [9, 9, 9]], sampling_params=GREEDY)
    assert [r.output_ids for r in reqs] == [w["output_ids"] for w in want]


def test_request_time_stats_are_logged_as_each_request_ends(artefact, caplog) -> None:
    """--enable-request-time-stats-logging: SGLang's line, with the wait for a first step
    and the time from there to the end."""
    engine = Engine(
        artefact("llama"), max_total_tokens=1024, enable_request_time_stats_logging=True
    )
    with caplog.at_level(logging.INFO, logger="kiln.engine"):
        out = engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    rid = out["meta_info"]["id"]
    [line] = [r.getMessage() for r in caplog.records if "Req Time Stats" in r.getMessage()]
    head = f"Req Time Stats(rid={rid}, input len={out['meta_info']['prompt_tokens']}, output len=3"
    assert line.startswith(head + ", type=unified): queue_duration=")
    queue, forward = (float(x.split("=")[1].removesuffix("ms")) for x in line.split(", ")[4:6])
    assert queue >= 0 and forward > 0


def test_fp32_lm_head_gives_a_bfloat16_model_float32_logits(artefact) -> None:
    """--enable-fp32-lm-head: float32 logits where a bfloat16 lm_head rounds them to 8
    significant bits; the same hidden states and sums, so they are the bfloat16 logits to
    within that rounding, and generation samples from them."""
    import torch

    prompt = [5, 17, 33, 8, 91, 12]
    bf16 = {"dtype": "bfloat16"}
    plain = Engine(artefact("llama", compile_args=bf16), max_total_tokens=256)
    wide = Engine(
        artefact("llama", compile_args={**bf16, "enable_fp32_lm_head": True}),
        max_total_tokens=256,
    )
    l16, l32 = plain.prompt_logits(prompt), wide.prompt_logits(prompt)
    assert l16.dtype == torch.bfloat16 and l32.dtype == torch.float32
    assert not torch.equal(l32.to(torch.bfloat16).float(), l32)  # more than 8 bits kept
    torch.testing.assert_close(l32, l16.float(), rtol=2**-8, atol=1e-3)
    out = wide.generate(input_ids=prompt, sampling_params=GREEDY)
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    assert out["output_ids"][0] == int(l32[-1].argmax())


def test_continuous_decode_steps_change_no_answer(artefact) -> None:
    """--num-continuous-decode-steps 4 reorders steps, not what each request computes."""
    from kiln.runtime.sampling_params import SamplingParams

    art = artefact("llama")
    want = Engine(art, max_total_tokens=512).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine = Engine(art, max_total_tokens=512, num_continuous_decode_steps=4)
    assert engine.scheduler.cfg.continuous_decode_steps == 4
    first = engine.make_request(list(PROMPTS[0]), SamplingParams(**GREEDY))
    engine.add_request(first)
    engine.step()
    engine.step()  # a decode step: three more come before the next prompt
    later = [engine.make_request(list(p), SamplingParams(**GREEDY)) for p in PROMPTS[1:]]
    for r in later:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
        assert all(r.kv_len == 0 for r in later)
    while any(not r.finished for r in [first, *later]):
        engine.step()
    assert [r.output_ids for r in [first, *later]] == [w["output_ids"] for w in want]


def test_holding_keeps_new_requests_waiting_without_failing(engine) -> None:
    """While new weights are on the way (scheduler.holding, /update_weights_from_disk), a
    waiting request is neither started nor taken for a pool too small for it (a step once
    raised the KV pool's MemoryError, which ended every request): the engine is idle, and
    the request runs to its end once let go."""
    req = engine.make_request([1, 2, 3], engine_params())
    engine.add_request(req)
    engine.scheduler.holding = True
    try:
        assert engine.step() == [] and not engine.has_work
        assert req in engine.scheduler.waiting
    finally:
        engine.scheduler.holding = False
    while engine.has_work:
        engine.step()
    assert req.finished and len(req.output_ids) == GREEDY["max_new_tokens"]


def test_weights_read_into_memory_do_not_follow_the_file(artefact, tmp_path) -> None:
    """--weight-loader-disable-mmap: the engine answers as the mapped one does, and a
    weights file rewritten in place under it changes nothing served (the servers of
    tests/serve/test_openai_server.py show no process maps the file)."""
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artefact("llama"), art)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    mapped = Engine(art, max_total_tokens=512).generate(input_ids=[5, 6, 7], sampling_params=params)
    engine = Engine(art, max_total_tokens=512, weight_loader_disable_mmap=True)
    first = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert first["output_ids"] == mapped["output_ids"]
    weights = art / "weights/rank0.safetensors"
    with weights.open("r+b") as f:  # every byte after the header zeroed, in place
        header = 8 + int.from_bytes(f.read(8), "little")
        f.seek(header)
        f.write(bytes(weights.stat().st_size - header))
    engine.flush_cache()
    again = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert again["output_ids"] == first["output_ids"]
