"""The pass manager: runs passes in order, each on the options it declared."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from kiln.core.check import lint
from kiln.core.ir import Graph, IRError
from kiln.passes.options import CompileOptions, OptionsView, Pass, reads_of

log = logging.getLogger("kiln.compile")


class PassError(RuntimeError):
    """A pass failed, or left the graph broken; the message names the passes before it."""


def run_passes(
    graph: Graph, options: CompileOptions, passes: Sequence[Pass], lint_each: bool = True
) -> tuple[Graph, list[dict[str, Any]]]:
    """Run `passes` in order; return the final graph and one log entry per pass (what it
    did; how long it took goes to the debug log, not the artefact, which must not differ
    between two compiles of the same inputs)."""
    entries: list[dict[str, Any]] = []
    for p in passes:
        name = getattr(p, "__name__", repr(p))
        before = len(graph.nodes)
        view = cast(CompileOptions, OptionsView(options, reads_of(p), name))
        t0 = time.perf_counter()
        try:
            result = p(graph, view)
            if lint_each:
                lint(result.graph)
        except (IRError, ValueError, KeyError) as e:
            ran = ", ".join(e["pass"] for e in entries) or "none"
            raise PassError(f"pass {name} failed: {e} (passes before it: {ran})") from e
        log.debug("pass %s: %.4f s", name, time.perf_counter() - t0)
        graph = result.graph
        entries.append(
            {
                "pass": name,
                "changed": result.changed,
                "nodes_before": before,
                "nodes_after": len(graph.nodes),
            }
        )
    return graph, entries
