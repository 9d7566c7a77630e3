"""QKV fusion: the q, k and v projections feeding one attention become one linear."""

from __future__ import annotations

from kiln.core.ir import Graph, Node
from kiln.passes.linear_fusion import fusable, fuse_linears
from kiln.passes.options import CompileOptions, PassResult, compiler_pass

# Ops that may sit between a projection and attention (per-head norm, rotary embedding).
_PER_HEAD = ("rope", "rmsnorm")


def _projection(node: Node) -> Node:
    while node.op in _PER_HEAD:
        node = node.args[0]
    return node


@compiler_pass()
def fuse_qkv(graph: Graph, ctx: CompileOptions) -> PassResult:
    changed = False
    for attn in [n for n in graph.nodes if n.op == "attention"]:
        linears = [_projection(a) for a in attn.args[:3]]
        if len({id(n) for n in linears}) == 3 and fusable(graph, linears):
            fuse_linears(graph, linears, "qkv_proj")
            changed = True
    return PassResult(graph, changed)
