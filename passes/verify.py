"""Verify: the graph lints, every compute node has a kernel, and feature sizes agree.

Feature sizes (the last dim of each activation) are propagated from the weights
(`kiln.core.shapes`), so a fusion that stacks the wrong weights or a bad split fails
here, at compile time. The artefact loader runs the same check on what it reads.
"""

from __future__ import annotations

from kiln.core.check import check
from kiln.core.ir import Graph
from kiln.core.ops import STRUCTURAL_OPS
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass()
def verify(graph: Graph, ctx: CompileOptions) -> PassResult:
    for n in graph.nodes:
        if n.op not in STRUCTURAL_OPS and "backend" not in n.meta:
            raise ValueError(f"%{n.name}: no backend selected for {n.op}")
    check(graph)
    return PassResult(graph, False)
