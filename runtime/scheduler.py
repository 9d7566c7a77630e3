"""Continuous batching as bookkeeping: which requests run this step, and their KV pages.

No model here: `schedule` decides a `Batch`, the model runner executes it, `commit`
records the sampled tokens and gives the prefix cache the whole pages a prefill computed,
where requests arriving while that one still runs find them (as SGLang caches unfinished
requests). Each step either prefills (new requests, or the next chunk of a long prompt;
with mixed chunks the running requests decode in the same batch) or decodes every running
request. When the pool runs dry the newest running request is
retracted: its pages go back (to the prefix cache when there is one) and it is prefilled
again later, losing nothing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.kv_cache import PagePool
from kiln.runtime.kv_store import KVStore
from kiln.runtime.radix_cache import RadixCache, Space
from kiln.runtime.request import Request, Status

POLICIES = ("fcfs", "lpm", "random", "lof", "priority")
# Above this many waiting requests, lpm's prefix lookups cost more than they save.
LPM_MAX_WAITING = 128
# Uncached prompt tokens a request must share with one already in a prefill for it to wait
# a step and read them from the prefix cache instead (SGLang's in-batch threshold, 32).
IN_BATCH_SHARED = 32
# The most prompt tokens a scored request (the prompt's logprobs) feeds a step: each fed
# token's logits are kept, [tokens, vocab] float32 (100 MB at 49,152 tokens of vocabulary).
SCORED_CHUNK = 512


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: prompts are prefilled whole
    mixed_chunk: bool = False
    policy: str = "fcfs"
    priority: bool = False  # order by request priority first
    low_priority_first: bool = False
    preemption_threshold: int = 10
    conservativeness: float = 1.0
    seed: int = 0
    prefill_max_requests: int | None = None  # prompts a prefill batch takes at most
    # --max-loras-per-batch (with --enable-lora): distinct adapters among the running
    # requests, the base model counted as one; None, no limit
    max_loras: int | None = None
    # --num-continuous-decode-steps: after a decode step, this many more run back to back
    # (less one) before waiting requests are looked at; SGLang's: steadier decoding for
    # the running requests, a later first token for new ones
    continuous_decode_steps: int = 1


@dataclass
class Batch:
    requests: list[Request]
    new_tokens: list[list[int]]  # tokens each request feeds the model this step
    sample: list[bool]  # whether each request gets a new token (prompt complete)
    is_prefill: bool
    # A decode batch whose requests feed their last token and then drafted ones, every
    # fed token's logits checked (runtime/speculative.py).
    verify: bool = False
    # Per request of a prefill: every fed token's logits wanted (the prompt's logprobs),
    # not only the last's. Empty: none.
    scored: list[bool] = field(default_factory=list)

    def subset(self, start: int, stop: int | None) -> Batch:
        """The requests [start:stop] as a batch of their own."""
        part = slice(start, stop)
        return Batch(
            self.requests[part],
            self.new_tokens[part],
            self.sample[part],
            self.is_prefill,
            self.verify,
            self.scored[part],
        )

    def rows(self) -> list[int]:
        """How many logits rows each request gets: each fed token's when scored, else one
        when it samples."""
        scored = self.scored or [False] * len(self.requests)
        return [
            len(fed) if all_rows else int(sampled)
            for fed, sampled, all_rows in zip(self.new_tokens, self.sample, scored, strict=True)
        ]


def _tokens(req: Request) -> list[int]:
    """A request's tokens, without copying them when it has no output yet (a new one)."""
    return req.all_ids if req.output_ids else req.prompt_ids


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        config: SchedulerConfig,
        cache: RadixCache | None = None,
        store: KVStore | None = None,
        write_policy: str = "write_through",
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {config.policy!r}")
        self.pool = pool
        self.cfg = config
        self.cache = cache
        # The prefix cache's disk tier (runtime/kv_store.py): blocks the tree lacks are read
        # from it before a prompt is computed; blocks are kept there as they join the tree
        # (write_through), once a request reads them from the tree (write_through_selective:
        # what is used twice), or as the tree evicts them (write_back).
        self.store = store if cache is not None else None
        policy = write_policy if self.store is not None else None
        self._write_through = policy == "write_through"
        self._write_on_hit = policy == "write_through_selective"
        if policy == "write_back" and cache is not None:
            cache.on_evict = self._keep_evicted
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # hold pages: decoding, or mid-way through a prompt
        self._rng = random.Random(config.seed)
        self._ratio_start = 0.7 * config.conservativeness
        self._ratio_floor = 0.1 * config.conservativeness
        self.new_token_ratio = self._ratio_start
        self._decodes_left = 0  # of a --num-continuous-decode-steps run
        # New weights on the way (runtime/weight_update.py): waiting requests are not
        # started until the running ones are done and the weights are in.
        self.holding = False
        # Called when a request's pages go back (finished or retracted): a draft model's
        # pages for it go too (runtime/speculative.py DraftModel.release).
        self.on_release: Callable[[Request], None] | None = None

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        needed = self.pool.pages_for(req.num_tokens + 1)
        if needed > self.pool.num_pages:
            raise ValueError(
                f"request {req.rid} needs {req.num_tokens + 1} KV tokens; the "
                f"pool holds {self.pool.num_pages * self.pool.page_size}"
            )
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        """Something a step would do: requests running, or waiting and free to start."""
        return bool(self.running or (self.waiting and not self.holding))

    def _key(self, req: Request) -> tuple[Any, ...]:
        prio = -req.priority if not self.cfg.low_priority_first else req.priority
        return (prio,) if self.cfg.priority or self.cfg.policy == "priority" else ()

    def _ordered(self) -> list[Request]:
        reqs = list(self.waiting)
        policy = self.cfg.policy
        if policy == "random":
            self._rng.shuffle(reqs)
        elif policy == "lof":
            reqs.sort(key=lambda r: -r.params.max_new_tokens)
        elif policy == "lpm" and self.cache is not None and len(reqs) <= LPM_MAX_WAITING:
            reqs.sort(key=lambda r: -self._cached_len(r))
        return sorted(reqs, key=self._key)  # stable: the policy order breaks priority ties

    def _cached_len(self, req: Request) -> int:
        assert self.cache is not None
        return self.cache.prefix_len(req.all_ids[:-1], req.prefix_space)

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        if self._decodes_left > 0:  # within a run of decode steps: no prefill
            self._decodes_left -= 1
            if (decode := self._decode()) is not None:
                return decode
            self._decodes_left = 0
        batch = self._prefill()
        if batch is None:
            decode = self._decode()
            if decode is not None:
                self._decodes_left = self.cfg.continuous_decode_steps - 1
            return decode
        if self.cfg.mixed_chunk:
            decoding = [r for r in self._decodable() if r not in batch.requests]
            self._make_room(decoding)
            decoding = [r for r in decoding if r.status is Status.RUNNING]
            batch.requests += decoding
            batch.new_tokens += [[r.last_id] for r in decoding]
            batch.sample += [True] * len(decoding)
            batch.scored += [False] * len(decoding)
        return batch

    def _decodable(self) -> list[Request]:
        return [r for r in self.running if r.kv_len == r.num_tokens - 1]

    def _prefill(self) -> Batch | None:
        budget = self.cfg.max_prefill_tokens
        if self.cfg.chunked_prefill_size:
            budget = min(budget, self.cfg.chunked_prefill_size)
        picked: list[Request] = []
        fed: list[list[int]] = []
        # A prompt mid-way through chunked prefill goes first.
        queue = [r for r in self.running if r.kv_len < r.num_tokens - 1]
        queue += [] if self.holding else self._ordered()
        most = self.cfg.prefill_max_requests
        adapters = {r.lora for r in self.running} if self.cfg.max_loras else set()
        for req in queue:
            if most is not None and len(picked) >= most:
                break
            fresh = req.status is Status.WAITING
            if fresh and picked and self._computed_by(req, picked):
                continue  # next step it reads those pages from the prefix cache
            if fresh and self.cfg.max_loras and req.lora not in adapters:
                if len(adapters) >= self.cfg.max_loras:
                    continue  # waits until a running adapter's requests are done
                adapters.add(req.lora)
            full = fresh and len(self.running) >= self.cfg.max_running
            if full and not self._preempt_for(req):
                break
            # A scorer's prompt is computed whole: a cached prefix has no logits to give.
            scoring = req.scoring
            if fresh and self.cache is not None and not req.pages and not scoring:
                self._attach_prefix(req)
            remaining = req.num_tokens - req.kv_len
            take = min(remaining, SCORED_CHUNK) if scoring else remaining
            if take > budget:
                if self.cfg.chunked_prefill_size and budget > 0:
                    take = budget  # this prompt continues next step
                elif picked:
                    break
            if not self._reserve(req, take, fresh, picked):
                if fresh and req.pages and self.cache is not None:
                    self._detach_prefix(req)
                break
            if fresh:
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
                if req.started_at is None:
                    req.started_at = time.perf_counter()
            picked.append(req)
            fed.append(req.all_ids[req.kv_len : req.kv_len + take])
            budget -= take
            if take < remaining or budget <= 0:
                break
        if not picked:
            return None
        sample = [
            r.kv_len + len(f) == r.num_tokens and not r.scores_only
            for r, f in zip(picked, fed, strict=True)
        ]
        scored = [r.scoring for r in picked]
        return Batch(picked, fed, sample, is_prefill=True, scored=scored)

    def _computed_by(self, req: Request, picked: list[Request]) -> bool:
        """Whether a request already in this prefill computes at least IN_BATCH_SHARED
        tokens (whole pages) of `req`'s prompt past what the prefix cache holds: then `req`
        waits a step and starts from those pages (SGLang defers such requests under its
        cache-aware policies; kiln under every policy)."""
        if self.cache is None or req.scoring:
            return False
        page = self.pool.page_size
        need = max(IN_BATCH_SHARED, page)
        ids = _tokens(req)
        if len(ids) <= need:
            return False
        start = self.cache.prefix_len(ids[:-1], req.prefix_space)
        for other in picked:
            if other.prefix_space != req.prefix_space or other.scoring:
                continue
            theirs = _tokens(other)
            end = start
            while end + page < len(ids) and ids[end : end + page] == theirs[end : end + page]:
                end += page
            if end - start >= need:
                return True
        return False

    def _reserve(self, req: Request, take: int, fresh: bool, picked: list[Request]) -> bool:
        """Allocate pages for `take` more tokens of `req`, keeping room for the decode
        tokens of requests already running (scaled by --schedule-conservativeness)."""
        need = self.pool.pages_for(req.kv_len + take) - len(req.pages)
        reserve = 0
        if fresh and (self.running or picked):
            future = sum(
                r.params.max_new_tokens - len(r.output_ids) for r in [*self.running, *picked]
            )
            reserve = self.pool.pages_for(int(self.new_token_ratio * future))
        if not self._ensure_free(need + reserve):
            if not fresh or not self._ensure_free(need):
                return False
            if self.running or picked:
                return False  # only an idle server admits without the decode reserve
        req.pages += self.pool.allocate(need)
        return True

    def _ensure_free(self, pages: int) -> bool:
        short = pages - self.pool.free_pages
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pool.free_pages >= pages

    def _preempt_for(self, req: Request) -> bool:
        """Priority scheduling: retract a running request whose priority is worse than
        `req`'s by at least the preemption threshold."""
        if not (self.cfg.priority or self.cfg.policy == "priority"):
            return False
        sign = -1 if self.cfg.low_priority_first else 1
        worst = max(self.running, key=lambda r: (-sign * r.priority, r.created), default=None)
        if worst is None or sign * (req.priority - worst.priority) < self.cfg.preemption_threshold:
            return False
        self.retract(worst)
        return True

    def _decode(self) -> Batch | None:
        decoding = self._decodable()
        self._make_room(decoding)
        decoding = [r for r in decoding if r.status is Status.RUNNING]
        if not decoding:
            return None
        self.new_token_ratio = max(self._ratio_floor, self.new_token_ratio - 0.001)
        return Batch(
            decoding, [[r.last_id] for r in decoding], [True] * len(decoding), is_prefill=False
        )

    def _make_room(self, decoding: list[Request]) -> None:
        """A page for each decoding request's next token, retracting the newest to fit."""
        pages_for = self.pool.pages_for
        short = [(r, pages_for(r.num_tokens) - len(r.pages)) for r in decoding]
        short = [(r, n) for r, n in short if n > 0]
        total = sum(n for _, n in short)
        if total <= self.pool.free_pages:
            # the usual step: the pages are free, one allocation for the batch
            fresh, at = self.pool.allocate(total), 0
            for req, n in short:
                req.pages += fresh[at : at + n]
                at += n
            return
        for req, _ in short:
            while req.status is Status.RUNNING and (
                self.pool.pages_for(req.num_tokens) > len(req.pages)
            ):
                if self._ensure_free(1):
                    req.pages += self.pool.allocate(1)
                else:
                    self.retract(self.running[-1])

    def grow(self, req: Request, extra: int) -> bool:
        """Pages for `extra` drafted tokens past a decoding request's next one, from free
        pages only: a draft never evicts the prefix cache or retracts a request."""
        need = self.pool.pages_for(req.num_tokens + extra) - len(req.pages)
        if need <= 0:
            return True
        if self.pool.free_pages < need:
            return False
        req.pages += self.pool.allocate(need)
        return True

    def trim(self, req: Request) -> None:
        """Give back the pages a running request holds past what its next token needs
        (those rejected drafts were written to)."""
        keep = self.pool.pages_for(req.num_tokens)
        if len(req.pages) > keep:
            self.pool.free(req.pages[keep:])
            del req.pages[keep:]

    def retract(self, victim: Request) -> None:
        """Take a running request's pages back. It re-enters the queue at the front and is
        prefilled again (prompt plus what it already generated) when memory allows."""
        self.running.remove(victim)
        self._release(victim)
        victim.status = Status.WAITING
        victim.retractions += 1
        self.waiting.insert(0, victim)
        self.new_token_ratio = self._ratio_start

    # -- prefix cache ------------------------------------------------------------------------
    def _attach_prefix(self, req: Request) -> None:
        assert self.cache is not None
        pages, length, node = self.cache.match(req.all_ids[:-1], req.prefix_space)
        if self._write_on_hit and length:
            self._keep_hit(req, pages, length)
        if self.store is not None:
            pages, length, node = self._restore(req, pages, length, node)
        if length:
            self.cache.lock(node)
            req.pages, req.kv_len, req.cache_node = list(pages), length, node
            req.tree_len = length
            req.cached_tokens = max(req.cached_tokens, length)

    def _restore(self, req: Request, pages: list[int], length: int, node: Any) -> tuple:
        """The match (pages, length, node) extended by the blocks of `req`'s prompt the disk
        tier holds past it, read into free pool pages (the tree evicting for them, never
        the match) and given to the tree. A block the match covers in part is read whole,
        and the tree keeps its own pages of that part."""
        assert self.cache is not None and self.store is not None
        ids = req.all_ids[:-1]
        names = self.store.names(ids, req.prefix_space, req.page_names)
        first = length // self.store.block_tokens
        if names is None or first >= len(names):
            return pages, length, node
        want = self.store.stored(names[first:])
        if not want:
            return pages, length, node
        each = self.store.block_pages
        self.cache.lock(node)
        self._ensure_free(want * each)
        self.cache.unlock(node)
        blocks = min(want, self.pool.free_pages // each)
        fresh = self.pool.allocate(blocks * each)
        got = self.store.load(names[first : first + blocks], fresh)
        self.pool.free(fresh[got * each :])
        if not got:
            return pages, length, node
        end = (first + got) * self.store.block_tokens
        held = pages[: first * each] + fresh[: got * each]
        self.pool.free(self.cache.insert(ids[:end], held, req.prefix_space))
        return self.cache.match(ids[:end], req.prefix_space)

    def _keep(self, req: Request, full: int) -> None:
        """Write-through: the disk tier keeps the whole blocks of `req`'s first `full` pages
        (the tree's now)."""
        tokens = req.all_ids[: full * self.pool.page_size]
        self._save_blocks(tokens, req.prefix_space, req.pages, req.page_names)

    def _keep_hit(self, req: Request, pages: list[int], length: int) -> None:
        """Write-through-selective: the disk tier keeps the whole blocks of a prefix a
        request found in the tree (the second use of those K/V)."""
        self._save_blocks(req.all_ids[:length], req.prefix_space, pages, req.page_names)

    def _keep_evicted(self, space: Space, tokens: list[int], pages: list[int]) -> None:
        """Write-back: the disk tier keeps the whole blocks of a path the tree evicts the
        leaf of (those it holds already are skipped)."""
        self._save_blocks(tokens, space, pages, [])

    def _save_blocks(
        self, tokens: list[int], space: Space, pages: list[int], names: list[bytes]
    ) -> None:
        """Hand the disk tier the whole blocks of `tokens` (tree `space`), held by the
        first of `pages`; `names`: block names known so far (extended; they may reach
        further than `tokens`)."""
        assert self.store is not None
        if self.store.names(tokens, space, names) is not None:
            blocks = len(tokens) // self.store.block_tokens
            self.store.save(names[:blocks], pages[: blocks * self.store.block_pages])

    def _detach_prefix(self, req: Request) -> None:
        assert self.cache is not None and req.cache_node is not None
        self.cache.unlock(req.cache_node)
        req.pages, req.kv_len, req.cache_node, req.tree_len = [], 0, None, 0

    def _share_computed(self, req: Request) -> None:
        """Give the prefix cache the whole pages a running request's prefill has computed
        (SGLang's caching of unfinished requests), so that requests arriving while it runs
        share them instead of computing them again. The request keeps reading them, now
        the tree's and locked for it; where the tree already held a page of the same
        tokens (another request's, computed meanwhile), the request moves to that page and
        its own goes back to the pool."""
        assert self.cache is not None
        full = req.kv_len // self.pool.page_size
        if full * self.pool.page_size <= req.tree_len:
            return
        keep = req.all_ids[: full * self.pool.page_size]
        copies = self.cache.insert(keep, req.pages[:full], req.prefix_space)
        pages, length, node = self.cache.match(keep, req.prefix_space)
        assert length == len(keep), (length, len(keep))
        req.pages[:full] = pages
        self.pool.free(copies)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.tree_len = node, length
        if self._write_through:
            self._keep(req, full)

    def _release(self, req: Request) -> None:
        """Give a request's pages back: whole computed pages to the prefix cache (when on),
        the rest to the pool."""
        pages = req.pages
        if self.cache is not None:
            full = req.kv_len // self.pool.page_size
            keep = req.all_ids[: full * self.pool.page_size]
            if self._write_through and full * self.pool.page_size > req.tree_len:
                self._keep(req, full)
            self.pool.free(self.cache.insert(keep, pages[:full], req.prefix_space))
            pages = pages[full:]
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
        self.pool.free(pages)
        req.pages, req.kv_len, req.cache_node, req.tree_len = [], 0, None, 0
        if self.on_release is not None:
            self.on_release(req)

    # -- results ---------------------------------------------------------------------------
    def commit(self, batch: Batch, tokens: Iterable[int] | None) -> None:
        """Advance each request past what it fed; append the sampled tokens (one per
        request whose `sample` flag is set, in batch order; None: an embedding model's
        batch, which samples none)."""
        it = iter(tokens or ())
        share = batch.is_prefill and self.cache is not None
        for req, fed, sampled in zip(batch.requests, batch.new_tokens, batch.sample, strict=True):
            req.kv_len += len(fed)
            if sampled and tokens is not None:
                req.output_ids.append(next(it))
            if share and len(fed) > 1:  # a prompt's rows (a mixed batch's decode rows feed one)
                self._share_computed(req)

    def finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def flush_cache(self) -> int:
        return self.cache.reset() if self.cache is not None else 0

    @property
    def cached_pages(self) -> int:
        return self.cache.evictable_pages() if self.cache is not None else 0
