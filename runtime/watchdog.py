"""SGLang's watchdogs over the engine's steps (`--watchdog-timeout`, `--soft-watchdog-timeout`).

A step (one prefill chunk or decode batch, through every layer) that runs longer than the
soft timeout is logged once with what the engine thread was doing (its Python stack, the
batch's requests); one that runs longer than the hard timeout means the engine is stuck
(a kernel that never returns, a collective waiting on a rank that is alive but silent):
`on_timeout` is called with why, and the server answers every client and exits 1, so a
supervisor restarts it, where it would otherwise hang for good.

The watchdog sleeps until the earliest deadline of the step in progress (at most half a
limit), so it costs nothing between steps and reports a step within 1.5 limits of its
start, as SGLang's does. Both timeouts are
SGLang's, 300 s by default: a CPU server of a large model whose one prefill chunk
legitimately takes longer needs a larger --watchdog-timeout or a smaller
--chunked-prefill-size.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from kiln.runtime.engine_thread import EngineThread

log = logging.getLogger("kiln.watchdog")

IDLE_POLL_S = 1.0  # how often a watchdog looks for a step while none runs


class Watchdog:
    def __init__(
        self,
        engine: EngineThread,
        timeout: float | None,
        soft_timeout: float | None,
        on_timeout: Callable[[str], None],
    ) -> None:
        self.engine, self.timeout, self.soft_timeout = engine, timeout, soft_timeout
        self.on_timeout = on_timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-watchdog", daemon=True)
        self._soft_step = -1  # the last step the soft watchdog reported

    def start(self) -> None:
        if self.timeout or self.soft_timeout:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            step, started = self.engine.steps, self.engine.step_started
            if started is None:
                self._stop.wait(min(IDLE_POLL_S, *self._limits()))
                continue
            ran = time.monotonic() - started
            soft = self.soft_timeout
            if soft and ran >= soft and step != self._soft_step:
                self._soft_step = step
                log.warning(
                    "a step has run for %.1f s (--soft-watchdog-timeout %g)\n%s",
                    ran,
                    soft,
                    self._state(),
                )
            if self.timeout and ran >= self.timeout and self.engine.steps == step:
                why = (
                    f"the engine's step {step} ran for {ran:.1f} s without returning "
                    f"(--watchdog-timeout {self.timeout:g}); the server stops"
                )
                log.error("%s\n%s", why, self._state())
                self.on_timeout(why)
                return
            pending = [started + self.timeout] if self.timeout else []
            if soft and step != self._soft_step:
                pending.append(started + soft)
            wait = min(pending) - time.monotonic() if pending else IDLE_POLL_S
            # at most half a limit: the step waited on may end and a later one hang, which
            # is then seen within 1.5 limits of its start (SGLang's own bound)
            self._stop.wait(max(min(wait, min(self._limits()) / 2), 0.001))

    def _limits(self) -> list[float]:
        return [t for t in (self.timeout, self.soft_timeout) if t]

    def _state(self) -> str:
        """The batch and the engine thread's stack, read from this thread (a snapshot for a
        log: the engine thread may change them as they are read)."""
        try:
            running = [r.rid for r in list(self.engine.engine.scheduler.running)]
        except Exception:  # read while the engine thread changed it
            running = []
        ident = self.engine.ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        more = len(running) - 16
        shown = ", ".join(running[:16]) + (f" and {more} more" if more > 0 else "")
        return f"running requests ({len(running)}): {shown}\nthe engine thread:\n{stack}"
