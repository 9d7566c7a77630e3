"""Weight layout: linears that kiln_cpu runs get their weights stored as panels.

On fp32 CPU targets with kiln's native kernels, every linear becomes `packed_linear` and its
weight is written into the artefact in the panel layout of the target's build
(kiln/core/layout.py), so serving memory-maps the weights and never repacks them. An
embedding that shares its table with a linear (tied lm_head) reads the same panels
(`packed_embedding`): one copy of the table, not two.

The pass also records the micro-kernel choice by row count (`narrow_rows`, [lo, hi]): the
narrow tile (16 or 8 rows x one panel) for row counts in that range, the wide tile (6 or 4
rows x a group of panels, fewer loads per multiply-add and more weight streams in flight)
for all others. Measured per build with every linear of a SmolLM2-135M pass, 2 threads,
ms per pass (benchmarks/RESULTS.md, `kernels_cpu.py`):
  avx512: wide wins at 1-4 rows (16.2 against 18.1 at 1), narrow at 8-16 (27.8 against
          29.6 at 16), wide again from 32 (64.7 against 73.3 at 64)
  avx2:   wide wins everywhere but about 8 rows (25.4 narrow against 26.4)
The x86-64 baseline has no vector FMA; its linears stay on torch's runtime-dispatched GEMM.
"""

from __future__ import annotations

from kiln.core.ir import Graph, Node
from kiln.core.layout import panel_shape, panels_name
from kiln.passes.options import CompileOptions, PassResult, compiler_pass

NARROW_ROWS = {"avx512": [6, 16], "avx512_vnni": [6, 16], "avx2": [6, 8]}
_READERS = {"linear": "packed_linear", "embedding": "packed_embedding"}


def packs(ctx: CompileOptions) -> bool:
    """Whether the target's linears run kiln_cpu on panels."""
    native = ctx.native_kernels and not ctx.compiles_pieces
    return (
        ctx.device == "cpu" and ctx.dtype == "float32" and native and ctx.target.isa in NARROW_ROWS
    )


@compiler_pass("target", "dtype", "native_kernels", "capture")
def pack_weights(graph: Graph, ctx: CompileOptions) -> PassResult:
    if not packs(ctx):
        return PassResult(graph, False)
    layout = panels_name(*panel_shape(ctx.target))
    narrow = NARROW_ROWS[ctx.target.isa]
    users = graph.users()
    changed = False
    for param in [n for n in graph.nodes if n.op == "param"]:
        spec = graph.weight_of(param)
        readers = users.get(param, [])
        if spec is None or spec.layout != "rows" or not _all_packable(param, readers):
            continue
        spec.layout = layout
        for n in readers:
            if n.op == "linear":
                n.attrs = {
                    "out_features": spec.shape[0],
                    "narrow_rows": list(narrow),
                    "prologue": "none",
                }
            n.op = _READERS[n.op]
            n.meta.pop("backend", None)
        changed = True
    return PassResult(graph, changed)


def _all_packable(param: Node, readers: list[Node]) -> bool:
    """Every reader takes the weight as a linear's or an embedding's table, and at least
    one is a linear (an embedding alone keeps rows: panels only help the GEMM)."""
    ok = all(n.op in _READERS and n.args[1] is param and param not in n.args[2:] for n in readers)
    return ok and any(n.op == "linear" for n in readers)
