"""--enable-deterministic-inference (SGLang's flag): each attention node attends every row
on its own, whole (no run of a prompt's rows scored together, no row's keys split over
the threads: kernels/csrc/cpu_kernels.c decode_attention), so that a row's arithmetic does
not depend on what else a step holds: which requests came with it, how its prompt was
chunked, what the prefix cache gave it. The linears of float-activation quantized formats
(qlinear: one row, a few rows and a prompt's rows are tiles that round differently) run
each row as its own call. The other linears are the same for a row whatever rows share its
call (fp32 panels: one order of FMAs; int8 activations: exact integer sums), so they stay
as they are. A request's tokens and logprobs are then the same in any batch. The price:
prompts run row by row in those kernels (slower prefill at long prompts)."""

from __future__ import annotations

from kiln.core.ir import Graph
from kiln.core.ops import ATTENTION_OPS
from kiln.core.quant import FORMATS
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass("deterministic")
def deterministic(graph: Graph, ctx: CompileOptions) -> PassResult:
    if not ctx.deterministic:
        return PassResult(graph, False)
    for n in graph.nodes:
        if n.op in ATTENTION_OPS or (
            n.op == "quant_linear" and FORMATS[n.attrs["format"]].kernel == "qlinear"
        ):
            n.attrs["deterministic"] = 1
    return PassResult(graph, True)
