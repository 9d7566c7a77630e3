"""Residual add + RMSNorm fusion: rmsnorm(a + b) -> add_rmsnorm(a, b) = (normed, a + b)."""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass()
def fuse_add_rmsnorm(graph: Graph, ctx: CompileOptions) -> PassResult:
    changed = False
    for norm in [n for n in graph.nodes if n.op == "rmsnorm"]:
        total, weight = norm.args
        if total.op != "add" or norm.attrs["group"]:
            continue
        fused = graph.add(
            "add_rmsnorm", [*total.args, weight], {"eps": norm.attrs["eps"]}, before=total
        )
        normed = graph.add("getitem", [fused], {"index": 0}, before=total)
        summed = graph.add("getitem", [fused], {"index": 1}, before=total)
        graph.replace_all_uses(norm, normed)
        graph.replace_all_uses(total, summed)
        graph.remove(norm)
        graph.remove(total)
        changed = True
    return PassResult(graph, changed)
