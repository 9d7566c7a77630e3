"""SGLang's /start_profile and /stop_profile for kiln: a trace of the engine's steps.

SGLang records torch's profiler; most of a kiln CPU step is one call into its lowered C
step, which torch cannot see inside. kiln records its own: each step (its kind and rows,
from its start to the end of its outputs), and, where the step ran natively, each of its
calls (op, weight format and shape, from the step's own clock readings: runtime/
native_step.py `profile`). The trace is Chrome's trace-event JSON, gzipped, as SGLang's
files are (`{output_dir}/{profile_id}-TP-0.trace.json.gz`): Perfetto and chrome://tracing
open it. Rank 0's steps only (the other ranks run the same calls on their parts).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kiln.core.ir import Node
    from kiln.runtime.artefact import Artefact
    from kiln.runtime.native_step import NativeStep
    from kiln.runtime.scheduler import Batch

MAX_STEPS = 10_000  # a profile's steps at most (its events are held in memory)


def call_label(art: Artefact, n: Node) -> str:
    """A native call's kind: op, weight format and, for a linear, in -> out features."""
    if not n.op.endswith("_linear"):
        return n.op
    out, inp = art.graph.weights[n.args[1].attrs["name"]].shape[:2]
    kind = f"quant_linear {n.attrs['format']}" if n.op == "quant_linear" else n.op
    return f"{kind} {inp} -> {out}"


class StepProfile:
    """One profile in progress: `step_done` after each step; `num_steps` steps end it by
    themselves (None: /stop_profile does), after `start_step` steps skipped."""

    def __init__(
        self,
        art: Artefact,
        native: NativeStep | None,
        path: Path,
        num_steps: int | None = None,
        start_step: int = 0,
    ) -> None:
        self.art, self.native, self.path = art, native, path
        self.num_steps = min(num_steps or MAX_STEPS, MAX_STEPS)
        self.skip = start_step
        self.events: list[dict[str, Any]] = []
        self.steps = 0
        self.done = False
        self._labels: list[tuple[str, str]] = []  # each native call's label and node
        self._ticks: np.ndarray | None = None
        if native is not None:
            nodes = art.graph.nodes
            self._labels = [(call_label(art, nodes[i]), nodes[i].name) for i in native.call_nodes()]
            self._ticks = native.profile(True)
        self._origin = time.monotonic_ns()  # the trace's time 0 (the C step's clock too)

    def step_started(self) -> int:
        if self._ticks is not None:
            self._ticks[0] = 0  # a native call this step writes its readings over it
        return time.monotonic_ns()

    def step_done(self, started: int, batch: Batch) -> None:
        """Record the step that began at `started` (ns) and ran `batch`; finish the profile
        once it has its steps."""
        end = time.monotonic_ns()
        if self.skip > 0:
            self.skip -= 1
            return
        kind = "verify" if batch.verify else "prefill" if batch.is_prefill else "decode"
        rows = sum(len(t) for t in batch.new_tokens)
        shape = {"requests": len(batch.requests), "rows": rows}
        self.events.append(self._event(f"{kind} step", started, end, 0, shape))
        ticks = self._ticks
        if ticks is not None and ticks[0] >= started:  # the step ran natively
            for c, (label, node) in enumerate(self._labels):
                self.events.append(self._event(label, int(ticks[c]), int(ticks[c + 1]), 1,
                                               {"node": node}))  # fmt: skip
        self.steps += 1
        if self.steps >= self.num_steps:
            self.finish()

    def _event(self, name: str, start: int, end: int, tid: int, args: dict[str, Any]) -> dict:
        return {"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": (start - self._origin) / 1e3,
                "dur": max(0, end - start) / 1e3, "args": args}  # fmt: skip

    def finish(self) -> None:
        """Stop recording and write the trace (on a thread of its own: a step does not
        wait for the file)."""
        if self.done:
            return
        self.done = True
        if self.native is not None:
            self.native.profile(False)
        names = {0: "steps", 1: "native step calls"}
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
                for t, n in names.items()]  # fmt: skip
        trace = {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}
        threading.Thread(target=_write, args=(self.path, trace), daemon=True).start()


def _write(path: Path, trace: dict[str, Any]) -> None:
    """The trace as gzipped JSON at `path`, a new file (never one that exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as out:
        out.write(json.dumps(trace).encode())
