"""Dead-code elimination: drop nodes nothing reaches from the output, and their weights."""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass()
def dce(graph: Graph, ctx: CompileOptions) -> PassResult:
    live: set[int] = set()
    for n in reversed(graph.nodes):
        if n.op in ("output", "input") or id(n) in live:
            live.add(id(n))
            live.update(id(a) for a in n.args)
    dead = [n for n in graph.nodes if id(n) not in live]
    for n in dead:
        graph.remove(n)
    used = {n.attrs["name"] for n in graph.nodes if n.op == "param"}
    for w in set(graph.weights) - used:
        del graph.weights[w]
    return PassResult(graph, bool(dead))
