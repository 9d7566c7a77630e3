"""Continuous batching as bookkeeping: which requests run this step, and their KV pages.

No model here: the scheduler decides a `Batch` (prefill some waiting requests, or decode
the running ones), the model runner executes it, and `commit` records the new tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kiln.runtime.kv_cache import PagePool
from kiln.runtime.request import Request, Status


@dataclass
class Batch:
    requests: list[Request]
    # Tokens of each request fed to the model this step (all uncached tokens on prefill).
    new_tokens: list[list[int]]
    is_prefill: bool


class Scheduler:
    def __init__(self, pool: PagePool, max_running: int, max_prefill_tokens: int) -> None:
        self.pool = pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Prefill waiting requests when they fit, else decode every running request."""
        batch = self._prefill()
        return batch if batch is not None else self._decode()

    def _prefill(self) -> Batch | None:
        picked: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(picked) < self.max_running:
            req = self.waiting[0]
            uncached = req.num_tokens - req.kv_len
            if picked and uncached > budget:
                break
            pages = self.pool.pages_for(req.num_tokens) - len(req.pages)
            if not self.pool.can_allocate(pages):
                break
            req.pages += self.pool.allocate(pages)
            budget -= uncached
            picked.append(self.waiting.popleft())
        if not picked:
            return None
        for r in picked:
            r.status = Status.RUNNING
        self.running += picked
        return Batch(picked, [r.all_ids[r.kv_len :] for r in picked], is_prefill=True)

    def _decode(self) -> Batch | None:
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # retracted while making room for an older request
            while self.pool.pages_for(req.num_tokens) > len(req.pages):
                if self.pool.can_allocate(1):
                    req.pages += self.pool.allocate(1)
                elif self._retract_newest() is req:
                    break
        if not self.running:
            return None
        return Batch(list(self.running), [[r.all_ids[-1]] for r in self.running], False)

    def _retract_newest(self) -> Request:
        """Free the newest running request's pages. It re-enters the queue at the front and
        is prefilled again (prompt plus what it already generated) when memory allows."""
        victim = self.running.pop()
        self.pool.free(victim.pages)
        victim.pages, victim.kv_len = [], 0
        victim.status = Status.WAITING
        victim.retractions += 1
        self.waiting.appendleft(victim)
        return victim

    def commit(self, batch: Batch, tokens: list[int]) -> None:
        """Record each request's new token; the caller then calls `finish` on finished ones."""
        for req, fed, tok in zip(batch.requests, batch.new_tokens, tokens, strict=True):
            req.kv_len += len(fed)
            req.output_ids.append(tok)

    def finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.pages)
        req.pages = []
