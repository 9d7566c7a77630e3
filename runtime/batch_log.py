"""SGLang's scheduler log lines, which its users watch and parse: one for each prefill
batch, and one every --decode-log-interval decode batches with the generation throughput
since the last (SGLang's wording and fields):

    Prefill batch. #new-seq: 2, #new-token: 57, #cached-token: 16, token usage: 0.01,
        #running-req: 3, #queue-req: 0
    Decode batch. #running-req: 3, #token: 180, token usage: 0.01,
        gen throughput (token/s): 92.40, #queue-req: 0

(each one line). Token usage is the KV pool's pages in use, as the kiln:token_usage gauge.
"""

from __future__ import annotations

import logging
import time

from kiln.runtime.kv_cache import PagePool
from kiln.runtime.request import RequestOutput
from kiln.runtime.scheduler import Batch, Scheduler

log = logging.getLogger("kiln.runtime")


class BatchLog:
    def __init__(self, interval: int, scheduler: Scheduler, pool: PagePool) -> None:
        if interval < 1:
            raise ValueError(f"--decode-log-interval must be >= 1, got {interval}")
        self.interval = interval
        self.scheduler, self.pool = scheduler, pool
        self._decodes = 0
        self._generated = 0
        self._since: float | None = None

    def after(self, batch: Batch, outputs: list[RequestOutput]) -> None:
        """Count (and, when due, log) a step that has run and gave `outputs` (their tokens
        a verify step's kept drafts too): its requests' lengths are already past what it
        fed."""
        if not log.isEnabledFor(logging.INFO):
            return
        usage = self.pool.usage
        sched = self.scheduler
        if batch.is_prefill:
            new = cached = fed_tokens = 0
            for req, fed in zip(batch.requests, batch.new_tokens, strict=True):
                before = req.kv_len - len(fed)
                if before < len(req.prompt_ids):  # a prompt's chunk, not a mixed-in decode
                    new += 1
                    fed_tokens += len(fed)
                    cached += req.cached_tokens if before == req.cached_tokens else 0
            log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d",
                new, fed_tokens, cached, usage, len(sched.running), len(sched.waiting),
            )  # fmt: skip
            return
        self._decodes += 1
        self._generated += sum(len(o.token_ids) for o in outputs)
        now = time.perf_counter()
        if self._since is None:  # the first decode step: the clock starts at its end
            self._since = now
        if self._decodes % self.interval:
            return
        # As SGLang: the tokens since the last line over the time since it.
        rate = self._generated / max(now - self._since, 1e-6)
        self._generated, self._since = 0, now
        log.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            len(batch.requests), sum(r.kv_len for r in batch.requests), usage, rate,
            len(sched.waiting),
        )  # fmt: skip
