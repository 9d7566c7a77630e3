"""The engine as the HTTP layer sees it: async streams of RequestOutput per request.

Request ids are the key of every stream, so they must be unique among requests in
flight: `claim` registers a batch's ids at once (on the event loop, so two handlers can
never both pass the check) and refuses one that is in use. The registry holds requests
weakly: a response that never starts (its client left) cannot keep an id claimed.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from typing import Any

from kiln.runtime.engine import Engine
from kiln.runtime.engine_thread import EngineThread
from kiln.runtime.request import Request, RequestOutput
from kiln.serve.request_log import CrashDump, MetricsFile, RequestLog


class QueueFull(RuntimeError):
    """More requests are waiting than --max-queued-requests allows."""


class Unavailable(RuntimeError):
    """The server is shutting down and takes no new requests."""


class RidInUse(ValueError):
    """A request id that a request in flight already has."""


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_queued: int | None = None,
        request_log: RequestLog | None = None,
    ) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.request_log = request_log  # --log-requests
        self.metrics_file: MetricsFile | None = None  # --export-metrics-to-file
        self.crash_dump: CrashDump | None = None  # --crash-dump-folder
        self.thread = EngineThread(engine, self._on_output)
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._claimed: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Submitted and not started yet (in the engine's inbox or its waiting queue): counted
        # here, on the event loop, so back-to-back arrivals see each other at once.
        self._queued = 0
        self.draining = False
        # Why the server can take no more requests, when it is a failure (a lost rank).
        self.failure: str | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.thread.start()

    def stop(self) -> None:
        # After a failure the engine thread may be waiting on a lost rank for good.
        self.thread.stop(timeout=1.0 if self.failure else 10.0)

    def _on_output(self, out: RequestOutput) -> None:  # engine thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.rid)
        if stream is not None:
            stream.put_nowait(out)

    @property
    def num_waiting(self) -> int:
        return self._queued

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def claim(self, reqs: list[Request]) -> None:
        """Reserve the ids of `reqs`; RidInUse names the first already in flight."""
        seen: set[str] = set()
        for req in reqs:
            held = self._claimed.get(req.rid)
            if req.rid in seen or (held is not None and held is not req and not held.finished):
                raise RidInUse(f"rid {req.rid!r} is already in use by a request in flight")
            seen.add(req.rid)
        for req in reqs:
            self._claimed[req.rid] = req

    async def run(self, fn: Any) -> Any:
        """Run `fn(engine)` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.thread.call(fn))

    def abort_all(self, reason: dict[str, Any]) -> None:
        """Stop every request in flight now; each stream ends with `reason`."""
        self.abort(None, reason)

    def abort(self, rid: str | None, reason: dict[str, Any]) -> int:
        """Stop the request `rid` in flight (every one: None) now, each stream ending with
        `reason`; how many there were."""
        rids = list(self._streams) if rid is None else [rid] if rid in self._streams else []
        for r in rids:
            self.thread.abort(r, reason)
        return len(rids)

    async def pause(self, mode: str, reason: dict[str, Any]) -> int:
        """SGLang's /pause_generation: no step runs until `resume`; requests that arrive
        meanwhile wait in the queue. mode "abort": every request in flight ends now with
        `reason`; "retract": running requests give their KV pages back and are prefilled
        again on resume; "in_place": they keep them. How many requests were aborted or
        retracted (none in place)."""
        retracted = await asyncio.wrap_future(self.thread.pause(retract=mode == "retract"))
        return self.abort(None, reason) if mode == "abort" else retracted

    async def resume(self) -> None:
        await asyncio.wrap_future(self.thread.resume())

    @property
    def paused(self) -> bool:
        return self.thread.paused

    def in_flight(self) -> list[Request]:
        """The requests in flight (submitted and not finished)."""
        return [r for r in list(self._claimed.values()) if not r.finished]

    def fail_all(self, reason: dict[str, Any]) -> None:
        """End every stream in flight now with `reason`, here on the event loop: for when
        the engine thread cannot answer (a step waiting on a rank that is gone)."""
        self.draining = True
        self.failure = str(reason.get("message"))
        for rid, stream in list(self._streams.items()):
            stream.put_nowait(RequestOutput(rid, [], "", [], True, reason, 0, 0))

    def _ended(self, req: Request, reason: dict[str, Any] | None = None) -> None:
        """A request's stream ended (`reason` where the request does not say why: a
        client that went away): --log-requests' line, --export-metrics-to-file's record and
        --crash-dump-folder's."""
        if self.request_log is not None:
            self.request_log.finished(req, reason)
        if self.metrics_file is not None:
            self.metrics_file.finished(req, reason)
        if self.crash_dump is not None:
            self.crash_dump.finished(req, reason)

    async def stream(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit `req`; yield its outputs until it finishes. Closing the iterator early
        (the client went away) aborts the request, which frees its memory."""
        if self.draining:
            raise Unavailable(self.failure or "the server is shutting down")
        if self.max_queued is not None and self.num_waiting >= self.max_queued:
            raise QueueFull(
                f"the server has {self.num_waiting} queued requests "
                f"(--max-queued-requests {self.max_queued}); retry later"
            )
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[req.rid] = queue
        self._claimed[req.rid] = req
        self._queued += 1
        started = finished = False
        try:
            await asyncio.wrap_future(self.thread.submit(req))
            while not finished:
                out = await queue.get()
                if not started:
                    started = True
                    self._queued -= 1
                finished = out.finished
                if finished:
                    self._ended(req)
                yield out
        finally:
            if not started:
                self._queued -= 1
            self._streams.pop(req.rid, None)
            if not finished:
                self.thread.abort(req.rid)
                self._ended(req, {"type": "abort", "message": "the client went away"})
