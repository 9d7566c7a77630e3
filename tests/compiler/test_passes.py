from __future__ import annotations

from dataclasses import replace

import pytest

from kiln.core.check import infer_types, lint
from kiln.core.ir import Graph, IRError
from kiln.core.ops import STRUCTURAL_OPS as STRUCTURAL
from kiln.core.target import Target, cpu_target
from kiln.core.trace import trace
from kiln.models import ModelConfig, build
from kiln.passes import (
    PIPELINE,
    CompileOptions,
    PassError,
    PassResult,
    dce,
    fp32_lm_head,
    fuse_add_rmsnorm,
    fuse_gate_up,
    fuse_qkv,
    fuse_rope,
    fuse_rope_attention,
    fuse_silu_linear,
    pack_weights,
    run_passes,
    select_backends,
    verify,
)

LAYERS = 3


def graph(model_type: str = "qwen2", tie: bool = False) -> Graph:
    cfg = ModelConfig.from_dict(
        {
            "tie_word_embeddings": tie,
            "model_type": model_type,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": 50,
        }
    )
    return trace(build(cfg))[0]


CTX = CompileOptions(target=cpu_target("avx512"), native_kernels=True)


def test_fuse_qkv_stacks_weights_and_biases() -> None:
    g = graph()
    linears = g.count("linear")
    result = fuse_qkv(g, CTX)
    assert result.changed
    lint(g)
    assert g.count("linear") == linears - 2 * LAYERS
    assert g.count("split") == LAYERS
    w = g.weights["model.layers.0.self_attn.qkv_proj.weight"]
    assert w.shape == (32 + 16 + 16, 32)
    assert [s["load"] for s in w.source["concat"]] == [
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"
    ]
    assert "model.layers.0.self_attn.qkv_proj.bias" in g.weights
    assert not fuse_qkv(g, CTX).changed


def test_fuse_qkv_sees_through_qk_norm() -> None:
    g = graph("qwen3")
    assert fuse_qkv(g, CTX).changed
    assert g.count("split") == LAYERS


def test_fuse_rope_takes_q_and_k_of_the_fused_projection_in_one_call() -> None:
    g = graph()
    fuse_qkv(g, CTX)
    assert fuse_rope(g, CTX).changed
    lint(g)
    assert g.count("rope_qkv") == LAYERS and g.count("rope") == 0 and g.count("split") == 0
    fused = next(n for n in g.nodes if n.op == "rope_qkv")
    assert fused.attrs == {"head_dim": 8, "sizes": [32, 16, 16]}
    assert not fuse_rope(g, CTX).changed
    infer_types(g)
    fused.attrs["sizes"] = [32, 12, 20]  # what an edited artefact could claim
    with pytest.raises(IRError, match="rope head_dim 8 does not divide q or k"):
        infer_types(g)
    # Qwen3's per-head q/k norm sits between the split and the rope: nothing to fuse.
    g3 = graph("qwen3")
    fuse_qkv(g3, CTX)
    assert not fuse_rope(g3, CTX).changed and g3.count("rope") == 2 * LAYERS


def test_fuse_rope_attention_reads_the_fused_projection_and_the_tables() -> None:
    g = graph()
    fuse_qkv(g, CTX)
    fuse_rope(g, CTX)
    attrs = [n.attrs for n in g.nodes if n.op == "attention"]
    assert fuse_rope_attention(g, CTX).changed
    lint(g)
    assert g.count("rope_attention") == LAYERS and g.count("attention") == 0
    assert g.count("rope_qkv") == 0 and g.count("getitem") == 0
    fused = [n for n in g.nodes if n.op == "rope_attention"]
    assert [n.attrs for n in fused] == attrs
    assert fused[0].args[0].op == "linear" and fused[0].args[1].op == "rope_cos_sin"
    assert not fuse_rope_attention(g, CTX).changed
    infer_types(g)
    fused[0].attrs["num_kv_heads"] = 1  # what an edited artefact could claim
    with pytest.raises(IRError, match="q, k and v features is 64, expected 48"):
        infer_types(g)
    # v read by something else too: the three outputs stay
    g2 = graph()
    fuse_qkv(g2, CTX)
    fuse_rope(g2, CTX)
    v = next(n for n in g2.nodes if n.op == "getitem" and n.attrs["index"] == 2)
    g2.add("add", [v, v], before=g2.output)
    assert fuse_rope_attention(g2, CTX).changed and g2.count("attention") == 1


def test_fuse_silu_linear_gives_the_activation_to_the_down_projection() -> None:
    g = graph()
    for p in (fuse_qkv, fuse_gate_up, pack_weights):
        p(g, CTX)
    acts = [n for n in g.nodes if n.op == "silu_and_mul"]
    downs = [g.users()[a][0] for a in acts]
    assert fuse_silu_linear(g, CTX).changed
    lint(g)
    assert g.count("silu_and_mul") == 0
    for act, down in zip(acts, downs, strict=True):
        assert down.attrs["prologue"] == "silu_and_mul" and down.args[0] is act.args[0]
    # qkv, o and gate_up per layer and the lm_head keep theirs
    nones = sum(n.attrs["prologue"] == "none" for n in g.nodes if n.op == "packed_linear")
    assert nones == 1 + LAYERS * 3
    infer_types(g)
    downs[0].attrs["prologue"] = "gelu"
    with pytest.raises(IRError, match="attr prologue: expected one of none, silu_and_mul"):
        infer_types(g)
    # A plain linear (no packed kernel for the target) keeps its activation node.
    g2 = graph()
    ctx = replace(CTX, target=cpu_target("x86-64"))
    for p in (fuse_qkv, fuse_gate_up, pack_weights):
        p(g2, ctx)
    assert not fuse_silu_linear(g2, ctx).changed and g2.count("silu_and_mul") == LAYERS


def test_fuse_gate_up_makes_silu_and_mul() -> None:
    g = graph()
    assert fuse_gate_up(g, CTX).changed
    lint(g)
    assert g.count("silu_and_mul") == LAYERS
    assert g.count("silu") == 0 and g.count("mul") == 0 and g.count("split") == 0
    assert g.weights["model.layers.2.mlp.gate_up_proj.weight"].shape == (128, 32)


def test_fuse_add_rmsnorm_keeps_the_residual_stream() -> None:
    g = graph()
    adds = g.count("add")
    assert fuse_add_rmsnorm(g, CTX).changed
    lint(g)
    # Every residual add feeding a norm fuses; the last one feeds index_select first.
    assert g.count("add_rmsnorm") == 2 * LAYERS - 1
    assert g.count("add") == adds - (2 * LAYERS - 1)


def test_dce_drops_unreachable_nodes_and_their_weights() -> None:
    g = graph()
    x = next(n for n in g.nodes if n.op == "embedding")
    w = g.param("model.layers.0.mlp.up_proj.weight")
    dead = g.add("linear", [x, w], before=g.output)
    before = len(g.nodes)
    assert dce(g, CTX).changed and dead not in g.nodes and len(g.nodes) == before - 1
    g.weights["unused"] = g.weights["rope.inv_freq"]
    g.param("unused")
    assert dce(g, CTX).changed and "unused" not in g.weights


def test_default_pipeline_logs_each_pass_and_picks_backends() -> None:
    g, log = run_passes(graph(), CTX, PIPELINE)
    assert [e["pass"] for e in log] == [p.__name__ for p in PIPELINE]
    compute = [n for n in g.nodes if n.op not in ("input", "param", "output", "getitem")]
    # fp32 on an AVX-512 CPU with the C kernels: linears packed, the ops kiln's C kernels
    # cover on kiln_cpu, the rest on torch.
    backend = {n.op: n.meta["backend"] for n in compute}
    # rope and rope_qkv fused into rope_attention, silu_and_mul into the down projection
    fused = ("rope", "rope_qkv", "attention", "silu_and_mul")
    assert not set(fused) & set(backend)
    native = ("rmsnorm", "add_rmsnorm", "rope_attention", "packed_linear")
    for op in native:
        assert backend.pop(op) == "kiln_cpu", op
    assert "linear" not in backend and set(backend.values()) == {"torch_native"}
    # Attention's kiln_cpu kernel runs decode steps; prefill steps take SDPA's reference.
    attn = next(n for n in g.nodes if n.op == "rope_attention")
    assert (attn.meta["backend"], attn.meta["prefill_backend"]) == ("kiln_cpu", "torch_native")
    g16, _ = run_passes(graph(), replace(CTX, dtype="bfloat16"), PIPELINE)
    assert {n.meta["backend"] for n in g16.nodes if n.op not in STRUCTURAL} == {"torch_native"}
    # --attention-backend torch_native keeps the reference attention, the rest unchanged.
    ctx = replace(CTX, attention_backend="torch_native")
    g_ref, _ = run_passes(graph(), ctx, PIPELINE)
    chosen = {n.op: n.meta["backend"] for n in g_ref.nodes if n.op not in STRUCTURAL}
    assert chosen["rope_attention"] == "torch_native" and chosen["rmsnorm"] == "kiln_cpu"
    # --prefill-attention-backend / --decode-attention-backend name one phase each.
    ctx = replace(CTX, decode_attention_backend="torch_native")
    g_dec, _ = run_passes(graph(), ctx, PIPELINE)
    attn = next(n for n in g_dec.nodes if n.op == "rope_attention")
    assert (attn.meta["backend"], attn.meta["prefill_backend"]) == ("torch_native",) * 2
    with pytest.raises(PassError, match="backend 'kiln_cpu' has no prefill rope_attention"):
        run_passes(graph(), replace(CTX, prefill_attention_backend="kiln_cpu"), PIPELINE)


def _weights_in(g: Graph, dtype: str) -> Graph:
    for spec in g.weights.values():
        if "constant" not in spec.source:
            spec.dtype = dtype  # as the compiler stores a 16-bit model's
    return g


@pytest.mark.parametrize("tie", [False, True])
def test_fp32_lm_head_widens_a_16_bit_models_lm_head_alone(tie: bool) -> None:
    ctx = replace(CTX, dtype="bfloat16", fp32_lm_head=True)
    g, log = run_passes(_weights_in(graph(tie=tie), "bfloat16"), ctx, PIPELINE)
    assert [e["changed"] for e in log if e["pass"] == "fp32_lm_head"] == [True]
    [head] = [n for n in g.nodes if n.meta.get("role") == "lm_head"]
    types = infer_types(g)
    assert head.op == "linear_fp32" and types[head.name].dtype == "float32"
    assert types[head.args[0].name].dtype == "bfloat16"  # widened inside the op
    assert g.weights[head.args[1].attrs["name"]].dtype == "bfloat16"  # stored as it was
    assert sum(n.op == "linear" for n in g.nodes) > 0  # the other linears stay 16-bit
    # a float32 model's logits are float32 already: nothing changes
    same = fp32_lm_head(graph(tie=tie), replace(CTX, fp32_lm_head=True))
    assert not same.changed and "linear_fp32" not in {n.op for n in same.graph.nodes}


def test_linear_fp32_widens_the_weight_in_blocks_to_the_same_sums() -> None:
    import torch

    from kiln.core.ops.linear import WIDEN_ROWS, linear_fp32

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2 * WIDEN_ROWS + 5, 16, generator=gen).bfloat16()
    x, b = torch.randn(3, 16, generator=gen).bfloat16(), torch.randn(len(w)).bfloat16()
    assert linear_fp32.reference is not None
    got = linear_fp32.reference(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # K summed as one GEMM sums it


@pytest.mark.parametrize(
    ("isa", "layout", "narrow"), [("avx512", "panels16x4", [6, 16]), ("avx2", "panels8x3", [6, 8])]
)
def test_layout_is_decided_by_the_target_alone(isa: str, layout: str, narrow: list[int]) -> None:
    ctx = replace(CTX, target=cpu_target(isa))
    g, _ = run_passes(graph("llama", tie=True), ctx, PIPELINE)
    packed = [n for n in g.nodes if n.op == "packed_linear"]
    # per layer qkv, o, gate_up, down; and the lm_head
    assert len(packed) == 1 + LAYERS * 4 and g.count("linear") == 0
    assert all(n.attrs["narrow_rows"] == narrow for n in packed)
    for n in packed:
        spec = g.weight_of(n.args[1])
        assert spec is not None and spec.layout == layout
        assert n.attrs["out_features"] == spec.shape[0]
    # The tied table: one copy, read as panels by the embedding too.
    (emb,) = [n for n in g.nodes if n.op == "packed_embedding"]
    assert emb.args[1] in [n.args[1] for n in packed] and emb.meta["backend"] == "kiln_cpu"
    assert len(g.weights) == len({id(w) for w in g.weights.values()})


@pytest.mark.parametrize(
    "ctx",
    [
        replace(CTX, target=cpu_target("x86-64")),  # no vector FMA: torch's GEMM
        replace(CTX, native_kernels=False),  # no C compiler where it compiled
        replace(CTX, target=Target("cuda", "sm_90")),
    ],
    ids=["x86-64", "no-compiler", "cuda"],
)
def test_linears_keep_rows_where_the_target_has_no_packed_kernel(ctx: CompileOptions) -> None:
    g, _ = run_passes(graph(), ctx, PIPELINE)
    assert g.count("packed_linear") == 0 and g.count("linear") == 1 + LAYERS * 4
    assert all(w.layout == "rows" for w in g.weights.values())
    native = {n.meta["backend"] for n in g.nodes if n.meta.get("backend") == "kiln_cpu"}
    assert native == ({"kiln_cpu"} if ctx.target.isa == "x86-64" else set())


def test_failure_names_the_passes_that_ran_before() -> None:
    def break_graph(g: Graph, ctx: CompileOptions) -> PassResult:
        g.nodes.reverse()
        return PassResult(g, True)

    with pytest.raises(PassError, match=r"break_graph failed.*before it: dce, fuse_qkv"):
        run_passes(graph(), CTX, [dce, fuse_qkv, break_graph])


def test_verify_catches_a_bad_split() -> None:
    g, _ = run_passes(graph(), CTX, [fuse_qkv, select_backends])
    split = next(n for n in g.nodes if n.op == "split")
    split.attrs["sizes"] = [16, 16, 32]
    with pytest.raises(ValueError, match="q features is 16, expected 32"):
        verify(g, CTX)


def test_select_backends_refuses_a_missing_backend() -> None:
    ctx = CompileOptions(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="backend 'flashinfer' has no decode attention kernel"):
        select_backends(graph(), ctx)
