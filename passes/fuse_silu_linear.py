"""Activation fusion: silu_and_mul(h) -> linear becomes the linear with prologue
"silu_and_mul", reading h itself.

The gated MLP's activation then runs inside the down projection's call (kiln's C kernels
compute it into the linear's input rows): one kernel call fewer per layer. Runs after the
layout and quantize passes, on the linears they made (`packed_linear`, `quant_linear`),
whose kernels all take the prologue; a plain `linear` keeps its activation node.
"""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.passes.options import CompileOptions, PassResult, compiler_pass

_TAKES_PROLOGUE = ("packed_linear", "quant_linear")


@compiler_pass()
def fuse_silu_linear(graph: Graph, ctx: CompileOptions) -> PassResult:
    users = graph.users()
    changed = False
    for act in [n for n in graph.nodes if n.op == "silu_and_mul"]:
        readers = users.get(act, [])
        if len(readers) != 1:
            continue
        linear = readers[0]
        if (
            linear.op not in _TAKES_PROLOGUE
            or linear.args[0] is not act
            or act in linear.args[1:]
            or linear.attrs["prologue"] != "none"
        ):
            continue
        linear.args[0] = act.args[0]
        linear.attrs["prologue"] = "silu_and_mul"
        linear.meta.pop("backend", None)
        graph.remove(act)
        changed = True
    return PassResult(graph, changed)
