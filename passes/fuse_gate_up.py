"""Gate/up fusion: mul(silu(x @ Wg), x @ Wu) -> silu_and_mul(x @ [Wg; Wu])."""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.passes.linear_fusion import fusable, fuse_linears
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass()
def fuse_gate_up(graph: Graph, ctx: CompileOptions) -> PassResult:
    changed = False
    users = graph.users()
    for mul in [n for n in graph.nodes if n.op == "mul"]:
        act, up = mul.args
        if act.op != "silu" or len(users[act]) != 1:
            continue
        gate = act.args[0]
        if len(users[gate]) != 1 or len(users[up]) != 1 or not fusable(graph, [gate, up]):
            continue
        fused = fuse_linears(graph, [gate, up], "gate_up_proj")
        # The split/getitems fuse_linears made now feed only act and mul: replace all four.
        split = next(n for n in graph.nodes if n.op == "split" and n.args[0] is fused)
        out = graph.add("silu_and_mul", [fused], before=mul)
        graph.replace_all_uses(mul, out)
        for dead in [mul, act, *(n for n in graph.nodes if n.args == [split]), split]:
            graph.remove(dead)
        users = graph.users()
        changed = True
    return PassResult(graph, changed)
