"""Backend selection: record in each node's meta which registered kernel runs it.

Rules come from measurements on the targets (kernels/onednn.py, benchmarks/RESULTS.md):
on CPU in fp32, the ops kiln's C kernels cover (linear, attention, norms, rope,
SiLU-and-mul) run on kiln_cpu where a C compiler can build them, else linears on oneDNN;
everything else on the reference kernels, unless the user asks for a backend
(--attention-backend)."""

from __future__ import annotations

from kiln.compiler.ir import STRUCTURAL_OPS, Graph
from kiln.kernels import cpu as cpu_kernels
from kiln.kernels import registry
from kiln.passes.base import PassContext, PassResult


def select_backends(graph: Graph, ctx: PassContext) -> PassResult:
    prefer: dict[str, str] = ctx.options.get("backends", {})
    changed = False
    for n in graph.nodes:
        if n.op in STRUCTURAL_OPS:
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
        choice = wanted or _preferred(n.op, ctx, have)
        if n.meta.get("backend") != choice:
            n.meta["backend"] = choice
            changed = True
    return PassResult(graph, changed)


def _preferred(op: str, ctx: PassContext, have: list[str]) -> str:
    if ctx.dtype == "float32" and "kiln_cpu" in have and cpu_kernels.available():
        return "kiln_cpu"
    if op == "linear" and ctx.dtype == "float32" and "onednn" in have:
        return "onednn"  # where kiln's C kernels cannot be built
    return "torch_native" if "torch_native" in have else have[0]
