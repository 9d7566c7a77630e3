"""SGLang's `--gc-warning-threshold-secs` and `/freeze_gc`: the cyclic garbage collector
holds the GIL while it walks the heap, which stalls the HTTP loop and the engine's step
alike; a collection longer than the threshold is logged, with the objects each generation
holds, so an operator can see the jitter's cause and freeze what the server holds."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger("kiln.gc")


def warn_long_collections(threshold_s: float) -> None:
    """Log every collection of this process that takes longer than `threshold_s`."""
    started: dict[Any, float] = {}

    def watch(phase: str, info: dict[str, Any]) -> None:
        gen = info.get("generation")
        if phase == "start":
            started[gen] = time.perf_counter()
            return
        took = time.perf_counter() - started.pop(gen, time.perf_counter())
        if took > threshold_s:
            counts = ", ".join(f"gen{i}={len(gc.get_objects(i))}" for i in range(3))
            log.warning(
                "garbage collection of generation %s took %.4f s (--gc-warning-threshold-secs "
                "%g); objects tracked: %s; %d frozen. POST /freeze_gc after a few warm-up "
                "requests exempts what the server holds by then",
                gen,
                took,
                threshold_s,
                counts,
                gc.get_freeze_count(),
            )

    gc.callbacks.append(watch)


def freeze() -> tuple[int, int]:
    """Exempt every object this process holds now from the collector (/freeze_gc): (frozen
    before, frozen after)."""
    before = gc.get_freeze_count()
    gc.freeze()
    after = gc.get_freeze_count()
    log.info("garbage collector: froze %d objects (%d frozen in all)", after - before, after)
    return before, after
