"""Prefix cache, chunked prefill and scheduling policies: outputs stay exact, bookkeeping
follows the policy."""

from __future__ import annotations

import pytest

from kiln import Engine
from kiln.runtime.kv_cache import PagePool
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
SHARED = list(range(3, 43))
PROMPTS = [[*SHARED, 50, 51], [*SHARED, 60], list(range(100, 160)), [7, 8, 9]]


@pytest.fixture(scope="module")
def reference(artefact) -> list[list[int]]:
    eng = Engine(
        artefact("mistral"),
        max_total_tokens=2048,
        disable_radix_cache=True,
        chunked_prefill_size=-1,
    )
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_prefix_cache_reuses_tokens_and_changes_nothing(artefact, reference) -> None:
    # Mistral's 16-token window: cached prefixes and windowed attention together.
    eng = Engine(artefact("mistral"), max_total_tokens=2048)
    first = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == len(PROMPTS[0]) - 1  # everything but the token that makes logits
    assert cached[1] >= len(SHARED) and cached[3] == 0
    pool = eng.runner.pool
    assert pool.free_pages + eng.scheduler.cached_pages == pool.num_pages
    assert eng.flush_cache() > 0 and pool.free_pages == pool.num_pages


@pytest.mark.parametrize(
    "args",
    [
        {"chunked_prefill_size": 8},
        {"chunked_prefill_size": 8, "enable_mixed_chunk": True},
        {"chunked_prefill_size": 16, "disable_radix_cache": True},
    ],
)
def test_chunked_prefill_changes_nothing(artefact, reference, args) -> None:
    eng = Engine(artefact("mistral"), max_total_tokens=2048, **args)
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference


def test_paged_prefix_cache_changes_nothing(artefact) -> None:
    art = artefact("qwen3", compile_args={"page_size": 4})
    ref = Engine(art, max_total_tokens=1024, disable_radix_cache=True).generate(
        input_ids=PROMPTS, sampling_params=GREEDY
    )
    eng = Engine(art, max_total_tokens=1024)
    eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    assert (
        outs[1]["meta_info"]["cached_tokens"] % 4 == 0
        and outs[1]["meta_info"]["cached_tokens"] >= 40
    )


def test_a_running_requests_prompt_is_shared_while_it_runs(artefact, reference) -> None:
    """A prompt's computed pages go to the prefix cache when its prefill ends, not when the
    request does: a request sharing its prefix that arrives while it decodes reads them
    (cached_tokens) and the answers stay exact, with chunked prefill sharing each chunk."""
    for args in ({}, {"chunked_prefill_size": 8}):
        eng = Engine(artefact("mistral"), max_total_tokens=2048, **args)
        first = eng.make_request(PROMPTS[0], SamplingParams(**GREEDY))
        eng.add_request(first)
        while not first.output_ids:  # its prompt in, it decodes from here
            eng.step()
        second = eng.make_request(PROMPTS[1], SamplingParams(**GREEDY))
        eng.add_request(second)
        while not (first.finished and second.finished):
            eng.step()
        assert second.cached_tokens >= len(SHARED) - 15, args  # whole pages of 16
        assert first.output_ids == reference[0] and second.output_ids == reference[1], args
        pool = eng.runner.pool
        assert pool.free_pages + eng.scheduler.cached_pages == pool.num_pages


# -- policies, as bookkeeping -----------------------------------------------------------------
def req(rid: str, n: int = 4, priority: int = 0, max_new: int = 8) -> Request:
    return Request(
        rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new), priority=priority
    )


def step(sched: Scheduler):
    batch = sched.schedule()
    assert batch is not None
    sched.commit(batch, [7] * sum(batch.sample))
    return batch


def admitted(sched: Scheduler) -> list[str]:
    batch = step(sched)
    assert batch.is_prefill
    return [r.rid for r in batch.requests]


def make(**cfg) -> Scheduler:
    base = {"max_running": 8, "max_prefill_tokens": 4, "conservativeness": 0.0}
    return Scheduler(PagePool(256, 1), SchedulerConfig(**{**base, **cfg}))


def test_fcfs_and_lof() -> None:
    s = make()
    for r in (req("a", max_new=2), req("b", max_new=9)):
        s.add(r)
    assert admitted(s) == ["a"]
    s = make(policy="lof")
    for r in (req("a", max_new=2), req("b", max_new=9)):
        s.add(r)
    assert admitted(s) == ["b"]


def test_priority_order_and_low_values_first() -> None:
    s = make(priority=True)
    for r in (req("low", priority=1), req("high", priority=5)):
        s.add(r)
    assert admitted(s) == ["high"]
    s = make(priority=True, low_priority_first=True)
    for r in (req("low", priority=1), req("high", priority=5)):
        s.add(r)
    assert admitted(s) == ["low"]


def test_priority_preemption_retracts_the_worst_running_request() -> None:
    s = make(priority=True, max_running=1, preemption_threshold=10, max_prefill_tokens=64)
    s.add(req("background", priority=0))
    assert admitted(s) == ["background"]
    s.add(req("urgent-but-close", priority=5))
    batch = step(s)  # gap 5 < 10: no preemption, background decodes
    assert [r.rid for r in batch.requests] == ["background"] and not batch.is_prefill
    s.add(req("urgent", priority=20))
    batch = step(s)
    assert [r.rid for r in batch.requests] == ["urgent"]
    assert s.waiting[0].rid == "background" and s.waiting[0].retractions == 1


def test_random_is_seeded() -> None:
    orders = []
    for _ in range(2):
        s = make(policy="random", seed=3, max_prefill_tokens=4)
        for i in range(6):
            s.add(req(f"r{i}"))
        orders.append(admitted(s))
    assert orders[0] == orders[1]


def test_conservativeness_keeps_room_for_decoding() -> None:
    def admitted_count(c: float) -> int:
        s = Scheduler(
            PagePool(64, 1),
            SchedulerConfig(max_running=16, max_prefill_tokens=64, conservativeness=c),
        )
        for i in range(8):
            s.add(req(f"r{i}", n=4, max_new=40))
        return len(s.schedule().requests)

    assert admitted_count(0.0) == 8
    assert admitted_count(1.0) < 8


def test_chunked_prompt_is_fed_in_pieces_without_sampling() -> None:
    s = Scheduler(PagePool(64, 1), SchedulerConfig(max_running=4, chunked_prefill_size=4))
    long = req("long", n=10)
    s.add(long)
    fed = []
    while True:
        batch = s.schedule()
        fed.append(len(batch.new_tokens[0]))
        s.commit(batch, [7] if batch.sample[0] else [])
        if batch.sample[0]:
            break
    assert fed == [4, 4, 2] and long.output_ids == [7] and long.kv_len == 10
