"""The pass interface and the pass manager."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.args import ArgError
from kiln.core.check import lint
from kiln.core.ir import Graph, IRError
from kiln.core.target import Target, cpu_target


@dataclass(frozen=True)
class PassContext:
    """What passes may read: the compile target and the compile-time arguments. Passes
    decide from these alone, never by probing the machine that compiles."""

    target: Target = field(default_factory=lambda: cpu_target("x86-64"))
    dtype: str = "float32"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.target.device


@dataclass
class PassResult:
    graph: Graph
    changed: bool


Pass = Callable[[Graph, PassContext], PassResult]


class PassError(RuntimeError):
    """A pass failed, or left the graph broken; the message names the passes before it."""


def run_passes(
    graph: Graph, ctx: PassContext, passes: Sequence[Pass], lint_each: bool = True
) -> tuple[Graph, list[dict[str, Any]]]:
    """Run `passes` in order; return the final graph and one log entry per pass."""
    log: list[dict[str, Any]] = []
    for p in passes:
        name = getattr(p, "__name__", repr(p))
        before = len(graph.nodes)
        t0 = time.perf_counter()
        try:
            result = p(graph, ctx)
            if lint_each:
                lint(result.graph)
        except ArgError:
            raise  # the user's flag does not fit this model: their error, named, not a bug
        except (IRError, ValueError, KeyError) as e:
            ran = ", ".join(e["pass"] for e in log) or "none"
            raise PassError(f"pass {name} failed: {e} (passes before it: {ran})") from e
        graph = result.graph
        log.append(
            {
                "pass": name,
                "changed": result.changed,
                "nodes_before": before,
                "nodes_after": len(graph.nodes),
                "seconds": round(time.perf_counter() - t0, 4),
            }
        )
    return graph, log
