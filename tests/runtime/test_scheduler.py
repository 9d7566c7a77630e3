"""The scheduler is bookkeeping: tested with a page pool and no model."""

from __future__ import annotations

from kiln.runtime.kv_cache import PagePool
from kiln.runtime.radix_cache import RadixCache
from kiln.runtime.request import Request, Status
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig


def cfg(max_running: int, max_prefill_tokens: int) -> SchedulerConfig:
    # No decode reserve: these tests count pages exactly.
    return SchedulerConfig(max_running, max_prefill_tokens, conservativeness=0.0)


def req(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=100))


def run_step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    assert batch is not None
    s.commit(batch, [token] * len(batch.requests))
    return batch


def test_prefill_first_then_decode_everyone() -> None:
    s = Scheduler(PagePool(64, 4), cfg(8, 100))
    a, b = req(5, "a"), req(3, "b")
    s.add(a)
    s.add(b)
    batch = run_step(s)
    assert batch.is_prefill and batch.new_tokens == [a.prompt_ids, b.prompt_ids]
    assert a.kv_len == 5 and a.output_ids == [7] and len(a.pages) == 2
    c = req(2, "c")
    s.add(c)
    assert run_step(s).requests == [c]  # a new arrival joins before the next decode
    batch = run_step(s)
    assert not batch.is_prefill and batch.requests == [a, b, c]
    assert batch.new_tokens == [[7], [7], [7]]


def test_prefill_budget_and_running_cap() -> None:
    s = Scheduler(PagePool(64, 1), cfg(2, 6))
    for i in range(3):
        s.add(req(4, f"r{i}"))
    assert len(run_step(s).requests) == 1  # 4 + 4 > 6: the second waits
    assert len(run_step(s).requests) == 1
    assert not run_step(s).is_prefill  # max_running reached: r2 waits
    assert [r.rid for r in s.waiting] == ["r2"]


def test_retraction_frees_the_newest_and_requeues_it() -> None:
    pool = PagePool(5, 2)
    s = Scheduler(pool, cfg(8, 100))
    old, new = req(3, "old"), req(3, "new")
    s.add(old)
    s.add(new)
    run_step(s)  # both prefilled (3 tokens, 2 pages each); 1 page left; 4 tokens after
    run_step(s)  # decode at 4 tokens: still 2 pages each; 5 tokens after
    batch = s.schedule()  # 5 tokens need 3 pages: old takes the last, new is retracted
    assert batch is not None and batch.requests == [old] and len(old.pages) == 3
    assert new.status is Status.WAITING and new.pages == [] and new.kv_len == 0
    assert new.retractions == 1 and s.waiting[0] is new
    assert len(new.output_ids) == 2  # what it generated is kept for its re-prefill


def test_finish_returns_pages_to_the_pool() -> None:
    pool = PagePool(16, 4)
    s = Scheduler(pool, cfg(8, 100))
    reqs = [req(n, str(n)) for n in (3, 6, 9)]
    for r in reqs:
        s.add(r)
    run_step(s)
    run_step(s)
    assert pool.free_pages < 16
    for r in reqs:
        s.finish(r, {"type": "length"})
    assert pool.free_pages == 16 and not s.has_work


def test_page_slots() -> None:
    pool = PagePool(8, 4)
    assert pool.slots([2, 0], 6).tolist() == [8, 9, 10, 11, 0, 1]


def test_continuous_decode_steps_hold_a_new_arrival_back() -> None:
    """--num-continuous-decode-steps 3: after a decode step two more run before a waiting
    request is prefilled; with 1 it is prefilled at the next step (as above)."""
    for steps, prefill_at in ((1, 0), (3, 2)):
        s = Scheduler(PagePool(64, 4), SchedulerConfig(8, 100, continuous_decode_steps=steps))
        a = req(5, "a")
        s.add(a)
        assert run_step(s).is_prefill
        assert not run_step(s).is_prefill  # the run of decode steps starts here
        s.add(req(2, "b"))
        kinds = [run_step(s).is_prefill for _ in range(3)]
        assert kinds.index(True) == prefill_at, (steps, kinds)
        after = run_step(s)  # a run starts again only after a decode step
        assert not after.is_prefill and len(after.requests) == 2


def test_a_run_of_decode_steps_ends_when_nothing_decodes() -> None:
    s = Scheduler(PagePool(64, 4), SchedulerConfig(8, 100, continuous_decode_steps=8))
    a = req(3, "a")
    s.add(a)
    run_step(s)
    run_step(s)  # a decode step: seven more would follow
    s.finish(a, {"type": "stop"})
    s.add(req(2, "b"))
    assert run_step(s).is_prefill  # no request decodes: the waiting one goes at once


def test_holding_starts_no_waiting_request_and_lets_the_running_finish() -> None:
    """While new weights are on the way (scheduler.holding): a waiting request is not
    prefilled, running ones still decode; let go, the waiting one starts."""
    s = Scheduler(PagePool(64, 4), cfg(8, 100))
    a, b = req(3, "a"), req(2, "b")
    s.add(a)
    run_step(s)
    s.holding = True
    s.add(b)
    for _ in range(3):
        batch = run_step(s)
        assert not batch.is_prefill and batch.requests == [a]
    s.finish(a, {"type": "stop"})
    assert s.schedule() is None and not s.has_work  # nothing runs, and b waits (idle)
    s.holding = False
    assert s.has_work
    assert run_step(s).requests == [b]


def test_a_prefill_gives_its_whole_pages_to_the_prefix_cache() -> None:
    """After a prefill the request's whole computed pages are the cache's, locked for it; a
    request of the same prefix arriving later starts from them; two that computed the
    same pages in one batch end up reading one copy, the other freed."""
    pool = PagePool(64, 4)
    s = Scheduler(pool, cfg(8, 100), RadixCache(pool))
    a = req(10, "a")  # two whole pages and two tokens
    s.add(a)
    run_step(s)
    assert a.tree_len == 8 and a.cache_node is not None and a.cache_node.locks == 1
    assert s.cache is not None and s.cache.evictable_pages() == 0  # in use: not evictable
    b = Request("b", [*range(1, 9), 50, 51], SamplingParams(max_new_tokens=100))
    s.add(b)
    batch = run_step(s)
    assert batch.requests == [b] and batch.new_tokens == [[50, 51]]
    assert b.cached_tokens == 8 and b.pages[:2] == a.pages[:2]
    new = list(range(100, 109))  # 9 tokens the cache does not have, twice in one batch
    c, d = (Request(rid, new, SamplingParams(max_new_tokens=100)) for rid in "cd")
    s.add(c)
    s.add(d)
    free = pool.free_pages
    batch = run_step(s)
    assert batch.requests == [c, d] and c.cached_tokens == d.cached_tokens == 0
    assert c.pages[:2] == d.pages[:2]  # d reads c's copy now
    assert pool.free_pages == free - 6 + 2  # d's two copies went back
    for r in (a, b, c, d):
        s.finish(r, {"type": "stop"})
    assert pool.free_pages + s.cached_pages == pool.num_pages


def test_a_prompt_another_in_the_batch_computes_waits_a_step_for_its_pages() -> None:
    """Two new requests sharing 32 uncached prompt tokens: the second waits one step and
    then starts from the first's pages; a request sharing fewer goes in the same batch."""
    pool = PagePool(64, 4)
    s = Scheduler(pool, cfg(8, 1000), RadixCache(pool))
    shared = list(range(1, 33))
    a, b = (
        Request(r, [*shared, t], SamplingParams(max_new_tokens=9))
        for r, t in [("a", 90), ("b", 91)]
    )
    near = Request("near", [*shared[:28], 92, 93, 94, 95, 96], SamplingParams(max_new_tokens=9))
    for r in (a, b, near):
        s.add(r)
    assert run_step(s).requests == [a, near]  # near shares 28 tokens: 7 pages, under 32
    batch = run_step(s)
    assert batch.is_prefill and batch.requests == [b] and b.cached_tokens == 32
    assert batch.new_tokens == [[91]]
