"""Stored responses of OpenAI's Responses API (serve/responses_api.py).

A response is kept when its request asks (`store`, true by default as in OpenAI's API),
with the conversation that led to it, so that a later request can continue it
(`previous_response_id`), fetch it (GET /v1/responses/{id}), list its input items or
delete it. A background response (`background: true`) is kept from the moment it is
queued: GET polls it, POST /v1/responses/{id}/cancel stops it.

The store lives in this process's memory, bounded by --max-stored-response-bytes (kiln's
flag, 64 MiB by default; 0 keeps nothing): a response that would pass the bound drops the
least recently used finished ones first (a later request naming one gets a 404), and a
running background response is never dropped. A response's id (`resp_` and 128 random
bits) is what lets a caller read, continue or stop it; ids are never listed.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BYTES = 64 * 1024 * 1024
RUNNING = ("queued", "in_progress")


@dataclass
class Stored:
    """`response`: the response object as GET returns it. `history`: the conversation up
    to and including this response's output, as Responses input items (reasoning left
    out), which a continuation puts before its own input. `inputs`: this request's own
    input items, each with an id. `task`: a background response's run."""

    response: dict[str, Any]
    history: list[dict[str, Any]]
    inputs: list[dict[str, Any]]
    task: asyncio.Task[None] | None = None
    size: int = field(default=0, init=False)

    def measure(self) -> int:
        self.size = len(json.dumps([self.response, self.history, self.inputs]))
        return self.size

    @property
    def running(self) -> bool:
        return self.response["status"] in RUNNING


class ResponseStore:
    def __init__(self, budget: int = DEFAULT_BYTES) -> None:
        self.budget = budget
        self.used = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> Stored | None:
        """The stored response `rid`, now the most recently used; None if unknown."""
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def put(self, rid: str, stored: Stored) -> bool:
        """Keep `stored` (again, after a change) as `rid`, dropping the least recently used
        finished responses while the bound is passed. False, and nothing kept, when it
        cannot fit: larger than the bound, or the running ones hold the rest."""
        old = self._items.pop(rid, None)
        if old is not None:
            self.used -= old.size
        size = stored.measure()
        held = sum(v.size for v in self._items.values() if v.running)  # never dropped
        if held + size > self.budget and not stored.running:
            return False  # before dropping anything for it
        for victim in [k for k, v in self._items.items() if not v.running]:
            if self.used + size <= self.budget:
                break
            self.used -= self._items.pop(victim).size
        self._items[rid] = stored
        self.used += size
        return True

    def delete(self, rid: str) -> Stored | None:
        stored = self._items.pop(rid, None)
        if stored is not None:
            self.used -= stored.size
        return stored
