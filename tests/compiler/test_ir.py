from __future__ import annotations

import pytest

from kiln.core.check import lint
from kiln.core.graph_json import load_graph
from kiln.core.ir import Graph, IRError
from kiln.core.trace import trace
from kiln.models import ModelConfig, build

CFG = ModelConfig.from_dict(
    {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 50,
    }
)


def traced() -> Graph:
    return trace(build(CFG))[0]


def test_trace_records_the_model_with_checkpoint_names() -> None:
    g = traced()
    lint(g)
    assert g.count("attention") == 2 and g.count("embedding") == 1
    assert "model.layers.1.self_attn.q_proj.bias" in g.weights
    assert g.weights["model.layers.0.mlp.up_proj.weight"].shape == (64, 32)
    assert g.weights["rope.inv_freq"].source == {"constant": "rope.inv_freq"}
    text = g.format()
    assert "attention(%" in text and "layer=1" in text
    assert text.splitlines()[-1].startswith("%output = output(")


def test_json_round_trip_is_exact() -> None:
    g = traced()
    g.nodes[5].meta["note"] = "kept"
    again = load_graph(g.dumps())
    assert again.format() == g.format()
    assert again.dumps() == g.dumps()


def test_lint_catches_broken_graphs() -> None:
    g = traced()
    g.nodes.insert(0, g.nodes.pop(-2))  # a use before its definition
    with pytest.raises(IRError, match="before it is defined"):
        lint(g)

    g = traced()
    g.add("frobnicate", before=g.output)
    with pytest.raises(IRError, match="unknown op 'frobnicate'"):
        lint(g)

    g = traced()
    del next(n for n in g.nodes if n.op == "attention").attrs["scale"]
    with pytest.raises(IRError, match=r"missing attrs \['scale'\]"):
        lint(g)

    g = traced()
    g.weights["orphan"] = g.weights["rope.inv_freq"]
    with pytest.raises(IRError, match="without a param node"):
        lint(g)
