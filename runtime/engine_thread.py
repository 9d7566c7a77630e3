"""The engine on its own thread: the HTTP loop stays responsive while the model computes.

Only this thread touches engine state. Other threads hand it work through `call`
(requests, aborts, cache flushes, stats) and get results back as futures; every
RequestOutput goes to the `on_output` callback, called on this thread.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kiln.core.lazy import prefetch
from kiln.runtime.engine import Engine
from kiln.runtime.request import Request, RequestOutput

log = logging.getLogger("kiln.engine")
T = TypeVar("T")

# A native-step artefact is served without torch (runtime/weights.py) until a request
# needs it (a grammar: xgrammar's matchers are torch's; a step the native step does not
# run); once the engine has answered a request and then idled this long, torch is
# imported in the background (not at start: a client's first request usually follows the
# start at once, and would share the CPU with the 2 s import).
TORCH_PREFETCH_IDLE_S = 0.5


def release_openmp_pool() -> None:
    """Hand back the calling thread's OpenMP worker threads (OpenMP 5's
    omp_pause_resource_all, hard). OpenMP keeps a pool of workers per thread that has run
    a parallel region; building the engine runs some (torch filling the KV pool, ...) on the
    thread that builds it, and while that pool lived, every kernel call of the engine thread
    was slower: a SmolLM2 Q4_K_M +a8 decode token 6.1 -> 11.5 ms on 2 Zen 4 cores (the
    engine thread's team and the idle one contend). torch and kiln's kernels share the one
    libgomp.so.1 of the process; without it (no OpenMP runtime loaded) there is nothing
    to hand back."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    pause(2)  # omp_pause_hard


class EngineThread:
    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput], None]) -> None:
        self.engine = engine
        self._on_output = on_output
        self._inbox: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        # /pause_generation: no step runs (calls still do) until resume(). Set and read on
        # this thread only.
        self.paused = False
        # The step in progress, for the watchdog (runtime/watchdog.py): its number and when
        # it began (None between steps).
        self.steps = 0
        self.step_started: float | None = None

    def start(self) -> None:
        release_openmp_pool()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between steps."""
        fut: Future[T] = Future()
        self._inbox.put((fn, fut))
        self._wake.set()
        return fut

    def submit(self, req: Request) -> Future[None]:
        def add(engine: Engine) -> None:
            engine.add_request(req)
            if req.finished:  # nothing to generate (e.g. max_new_tokens=0)
                self._on_output(engine.output(req))

        return self.call(add)

    def abort(self, rid: str, reason: dict[str, Any] | None = None) -> None:
        def stop(engine: Engine) -> None:
            out = engine.abort(rid, reason)
            if out is not None:
                self._on_output(out)

        self.call(stop)

    def pause(self, retract: bool) -> Future[int]:
        """Stop stepping after the step in progress; with `retract`, every running request
        gives its KV pages back and waits again at the front of the queue, to be prefilled
        anew (prompt and output so far) on resume. The future holds how many were."""

        def stop(engine: Engine) -> int:
            self.paused = True
            running = list(engine.scheduler.running) if retract else []
            for req in reversed(running):  # each goes to the front: the order is kept
                engine.scheduler.retract(req)
            return len(running)

        return self.call(stop)

    def resume(self) -> Future[None]:
        def go(engine: Engine) -> None:
            self.paused = False

        return self.call(go)

    def _drain(self) -> None:
        while True:
            try:
                fn, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller, who reports it
                    fut.set_exception(e)

    def _run(self) -> None:
        served, idle_since = False, None
        while not self._stopping.is_set():
            self._drain()
            if self.paused or not self.engine.has_work:
                self.engine.release_memory()  # a no-op unless pages fell free since
                now = time.monotonic()
                idle_since = idle_since or now
                if served and now - idle_since >= TORCH_PREFETCH_IDLE_S:
                    prefetch("torch")
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            served, idle_since = True, None
            self.steps += 1
            self.step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception:
                # Failures of a request's own inputs are isolated inside the step; this is
                # the scheduler's or the engine's own bookkeeping failing.
                log.exception("engine step failed; aborting the requests in flight")
                outputs = self._abort_all("internal error in the engine step")
            self.step_started = None
            for out in outputs:
                self._on_output(out)

    def _abort_all(self, message: str) -> list[RequestOutput]:
        sched = self.engine.scheduler
        outs = []
        reason = {"type": "abort", "message": message, "status_code": 500}
        for req in [*sched.running, *sched.waiting]:
            out = self.engine.abort(req.rid, reason)
            if out is not None:
                outs.append(out)
        return outs
