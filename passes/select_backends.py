"""Backend selection: record in each node's meta which registered kernel runs it.

Decided from the pass context alone (target, dtype, the toolchain's native-kernel support,
the user's --*-backend choices), never by probing the machine that compiles, so the same
inputs always give the same graph. On fp32 CPU targets the ops kiln's C kernels cover run on
kiln_cpu (measurements in benchmarks/RESULTS.md) where the node's shapes suit them; every
other node runs the reference kernels. CUDA targets take the triton kernels where there is
one (kernels/triton_ops.py) and the reference kernels (torch's cuBLAS GEMMs for the
linears) elsewhere. The runtime runs exactly what is recorded here.

--enable-deterministic-inference on a CUDA target takes only batch-invariant kernels
(kernels/registry.py: the Triton programs, the Triton linear in place of cuBLAS, and the
references that compute a row from that row alone); a node with none is refused, naming
its op. CPU targets get the flag's batch invariance from the lowered C step instead
(passes/deterministic.py), so their selection is unchanged.
"""

from __future__ import annotations

from kiln.core.ir import Graph, Node
from kiln.core.ops import ATTENTION_OPS, STRUCTURAL_OPS
from kiln.kernels import catalog
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass(
    "target",
    "dtype",
    "native_kernels",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "capture",
    "deterministic",
)
def select_backends(graph: Graph, ctx: CompileOptions) -> PassResult:
    changed = False
    for n in graph.nodes:
        if n.op in STRUCTURAL_OPS:
            continue
        if n.op in ATTENTION_OPS:  # a kernel for decode steps, one for the others
            picks = {
                "backend": _pick(n, ctx, "decode", ctx.decode_attention_backend),
                "prefill_backend": _pick(n, ctx, "prefill", ctx.prefill_attention_backend),
            }
        else:
            picks = {"backend": _pick(n, ctx, "decode", None)}
        for key, choice in picks.items():
            if n.meta.get(key) != choice:
                n.meta[key] = choice
                changed = True
    return PassResult(graph, changed)


def _pick(n: Node, ctx: CompileOptions, phase: str, flag: str | None) -> str:
    """The backend of `n` for `phase`: the flag's (--prefill- / --decode-attention-backend,
    else --attention-backend, for ops that attend), else kiln's choice."""
    invariant = ctx.deterministic and ctx.device == "cuda"
    have = catalog.available(n.op, ctx.device, phase, n.attrs, batch_invariant=invariant)
    if not have and invariant:
        why = _refused(n)
        raise ValueError(
            f"%{n.name}: --enable-deterministic-inference: kiln has no batch-invariant "
            f"{n.op} kernel on {ctx.device}" + (f" for its {why}" if why else "")
        )
    if not have:
        raise ValueError(f"%{n.name}: no kernel for op {n.op!r} on {ctx.device}")
    wanted = flag or (ctx.attention_backend if n.op in ATTENTION_OPS else None)
    if wanted is not None and wanted not in have:
        raise ValueError(
            f"%{n.name}: backend {wanted!r} has no {phase} {n.op} kernel on {ctx.device} "
            f"(available: {', '.join(have)})"
        )
    return wanted or _preferred(n, ctx, have)


def _refused(n: Node) -> str | None:
    """The attribute that keeps `n` off the kernels that would otherwise take it."""
    reasons = (k.refuses(n.attrs) for k in catalog.kernels() if k.op.name == n.op)
    return next((r for r in reasons if r), None)


def native_suits(n: Node) -> bool:
    """Shapes kiln's C kernels take: attention vectorises head_dim by 8 lanes."""
    return n.op not in ATTENTION_OPS or n.attrs["head_dim"] % 8 == 0


def _preferred(n: Node, ctx: CompileOptions, have: list[str]) -> str:
    if ctx.device == "cuda" and "triton" in have:
        return "triton"
    native = ctx.native_kernels
    # --enable-torch-compile: Inductor generates the code between the attention ops, so
    # those ops take the reference kernels it can trace (kiln's C kernels would be opaque
    # calls splitting every piece); attention, which runs between the pieces, keeps them,
    # and so do the quantized linears (the reference dequantizes a whole weight per call).
    if ctx.compiles_pieces and n.op not in ATTENTION_OPS and not n.op.startswith("quant_"):
        native = False
    if ctx.dtype == "float32" and native and "kiln_cpu" in have and native_suits(n):
        return "kiln_cpu"
    return "torch_native" if "torch_native" in have else have[0]
