"""Weight absorption for multi-head latent attention (DeepSeek V2 / V3).

The model definition writes MLA as it is defined: keys and values of every head made from
the pooled latent by kv_b_proj, then attention (`mla_attention`). Per cached token and
head that is (nope + v) x latent multiply-adds before a score is taken. Attention only
ever needs q . k and p . v, so kv_b's key half folds into the query and its value half
into the output:

    q_latent = head_linear(q_nope, W_uk)            # [tokens, heads * latent]
    o_latent = latent_attention(q_latent, q_rope, latent, k_rope)   # over the pool as it is
    out      = head_linear(o_latent, W_uv)          # [tokens, heads * v]

Each step then reads latent + rope features per cached token, shared by every head (one
"KV head", as multi-query attention), whatever the context. W_uk and W_uv are new weights
whose recipes cut kv_b (compiler/compile.py); kv_b itself leaves the graph (dce).

This runs for every step here; SGLang keeps the expanded form for long prefills on GPUs,
where it is cheaper in FLOPs, which a later, target-aware version of this pass can do.
"""

from __future__ import annotations

from kiln.core.ir import Graph, WeightSpec
from kiln.passes.options import CompileOptions, PassResult, compiler_pass


@compiler_pass()
def absorb_mla(graph: Graph, ctx: CompileOptions) -> PassResult:
    nodes = [n for n in graph.nodes if n.op == "mla_attention"]
    for mla in nodes:
        q_nope, q_rope, latent, k_rope, kv_b = mla.args
        spec = graph.weight_of(kv_b)
        if spec is None:
            raise ValueError(f"%{mla.name}: kv_b is not a weight")
        a = mla.attrs
        heads, nope, v, width = a["num_heads"], a["nope_dim"], a["v_dim"], a["latent_dim"]
        name = kv_b.attrs["name"]
        halves = {}
        for part, shape in (("k", (heads, width, nope)), ("v", (heads, v, width))):
            source = {"mla_absorb": spec.source, "heads": heads, "nope": nope, "part": part}
            graph.weights[f"{name}.absorbed_{part}"] = WeightSpec(shape, spec.dtype, source)
            halves[part] = graph.param(f"{name}.absorbed_{part}", before=mla)
        per_head = {"num_heads": heads}
        q_latent = graph.add("head_linear", [q_nope, halves["k"]], per_head, before=mla)
        args = [q_latent, q_rope, latent, k_rope]
        attend = graph.add("latent_attention", args, dict(a), before=mla)
        out = graph.add("head_linear", [attend, halves["v"]], per_head, before=mla)
        graph.replace_all_uses(mla, out)
        graph.remove(mla)
    return PassResult(graph, bool(nodes))
