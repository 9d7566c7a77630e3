"""--enable-fp32-lm-head (SGLang's flag): the logits of a 16-bit model in float32.

A bfloat16 (or float16) artefact's lm_head computes and returns 16-bit logits: bfloat16
keeps 8 significant bits, so logits a few hundredths apart at a magnitude of 10 round to
the same value, and the sampler's softmax, top-p and logprobs see ties that the model did
not make. With the flag the lm_head runs as `linear_fp32`: the final hidden state and the
weight widened to float32 (exactly: every 16-bit value is a float32), float32 sums, float32
logits, as SGLang does. The weight stays stored as it is (a tied lm_head shares the
embedding's table). A float32 model's logits are float32 already: the pass changes
nothing there.
"""

from __future__ import annotations

from kiln.core.check import infer_types
from kiln.core.ir import Graph
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass("fp32_lm_head")
def fp32_lm_head(graph: Graph, ctx: CompileOptions) -> PassResult:
    if not ctx.fp32_lm_head:
        return PassResult(graph, False)
    types = infer_types(graph)
    changed = False
    for n in graph.nodes:
        role = n.meta.get("role")
        if role == "lm_head" and n.op == "linear" and types[n.args[0].name].dtype != "float32":
            n.op = "linear_fp32"
            changed = True
    return PassResult(graph, changed)
