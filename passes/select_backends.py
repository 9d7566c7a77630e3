"""Backend selection: record in each node's meta which registered kernel runs it."""

from __future__ import annotations

from kiln.compiler.ir import Graph
from kiln.kernels import registry
from kiln.passes.base import PassContext, PassResult

# Structural ops the executor handles itself.
STRUCTURAL = frozenset({"input", "param", "output", "getitem"})


def select_backends(graph: Graph, ctx: PassContext) -> PassResult:
    prefer: dict[str, str] = ctx.options.get("backends", {})
    changed = False
    for n in graph.nodes:
        if n.op in STRUCTURAL:
            continue
        have = registry.available(n.op, ctx.device)
        if not have:
            raise ValueError(f"%{n.name}: no kernel for op {n.op!r} on {ctx.device}")
        wanted = prefer.get(n.op)
        if wanted is not None and wanted not in have:
            raise ValueError(
                f"%{n.name}: backend {wanted!r} has no {n.op} kernel on {ctx.device} "
                f"(available: {', '.join(have)})"
            )
        choice = wanted or have[0]
        if n.meta.get("backend") != choice:
            n.meta["backend"] = choice
            changed = True
    return PassResult(graph, changed)
