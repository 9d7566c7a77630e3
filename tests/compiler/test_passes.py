from __future__ import annotations

import pytest

from kiln.compiler.ir import STRUCTURAL_OPS as STRUCTURAL
from kiln.compiler.ir import Graph
from kiln.compiler.trace import trace
from kiln.kernels import cpu as cpu_kernels
from kiln.models import ModelConfig, build
from kiln.passes import (
    PIPELINES,
    PassContext,
    PassError,
    PassResult,
    dce,
    fuse_add_rmsnorm,
    fuse_gate_up,
    fuse_qkv,
    run_passes,
    select_backends,
    verify,
)

LAYERS = 3


def graph(model_type: str = "qwen2") -> Graph:
    cfg = ModelConfig.from_dict(
        {
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


CTX = PassContext()


def test_fuse_qkv_stacks_weights_and_biases() -> None:
    g = graph()
    linears = g.count("linear")
    result = fuse_qkv(g, CTX)
    assert result.changed
    g.lint()
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


def test_fuse_gate_up_makes_silu_and_mul() -> None:
    g = graph()
    assert fuse_gate_up(g, CTX).changed
    g.lint()
    assert g.count("silu_and_mul") == LAYERS
    assert g.count("silu") == 0 and g.count("mul") == 0 and g.count("split") == 0
    assert g.weights["model.layers.2.mlp.gate_up_proj.weight"].shape == (128, 32)


def test_fuse_add_rmsnorm_keeps_the_residual_stream() -> None:
    g = graph()
    adds = g.count("add")
    assert fuse_add_rmsnorm(g, CTX).changed
    g.lint()
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
    g, log = run_passes(graph(), CTX, PIPELINES["default"])
    assert [e["pass"] for e in log] == [p.__name__ for p in PIPELINES["default"]]
    compute = [n for n in g.nodes if n.op not in ("input", "param", "output", "getitem")]
    # fp32 on CPU: the ops kiln's C kernels cover (linears included) on kiln_cpu, the rest
    # on torch.
    backend = {n.op: n.meta["backend"] for n in compute}
    for op in cpu_kernels.OPS:
        assert backend.pop(op) == "kiln_cpu"
    assert set(backend.values()) == {"torch_native"}
    g16, _ = run_passes(graph(), PassContext(dtype="bfloat16"), PIPELINES["default"])
    assert {n.meta["backend"] for n in g16.nodes if n.op not in STRUCTURAL} == {"torch_native"}
    # --attention-backend torch_native keeps the reference attention, the rest unchanged.
    ctx = PassContext(options={"backends": {"attention": "torch_native"}})
    g_ref, _ = run_passes(graph(), ctx, PIPELINES["default"])
    chosen = {n.op: n.meta["backend"] for n in g_ref.nodes if n.op not in STRUCTURAL}
    assert chosen["attention"] == "torch_native" and chosen["rmsnorm"] == "kiln_cpu"


def test_failure_names_the_passes_that_ran_before() -> None:
    def break_graph(g: Graph, ctx: PassContext) -> PassResult:
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
    ctx = PassContext(options={"backends": {"attention": "flashinfer"}})
    with pytest.raises(ValueError, match="backend 'flashinfer' has no attention kernel"):
        select_backends(graph(), ctx)
