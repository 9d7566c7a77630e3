"""Compile options: one typed object; each pass sees only the fields it declares; the
tensor-parallel pass splits every linear by a rule or stops naming the node."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from kiln.core import ops
from kiln.core.trace import trace
from kiln.passes import (
    PIPELINE,
    CompileOptions,
    PassError,
    PassResult,
    compiler_pass,
    run_passes,
    shard,
)
from kiln.passes.options import TensorParallel

HIDDEN, WIDTH, VOCAB = 16, 32, 64


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class TinyLM(nn.Module):
    """An embedding, one MLP whose shape `mlp` picks, and an lm_head (no attention)."""

    def __init__(self, mlp: str) -> None:
        super().__init__()
        self.mlp = mlp
        self.embed = _weight(VOCAB, HIDDEN)
        self.gate = _weight(WIDTH, HIDDEN)
        self.up = _weight(WIDTH, HIDDEN)
        self.down = _weight(HIDDEN, WIDTH)
        self.norm = _weight(WIDTH)
        self.head = _weight(VOCAB, HIDDEN)

    def forward(self, ids, positions, rows):
        h = ops.embedding(ids, self.embed, role="embedding")
        if self.mlp == "gated":  # silu(gate) * up, with a second activation on top
            inner = ops.silu(ops.mul(ops.silu(ops.linear(h, self.gate)), ops.linear(h, self.up)))
        elif self.mlp == "plain":  # silu(up): a two-linear MLP
            inner = ops.silu(ops.linear(h, self.up))
        else:  # a norm inside the MLP: no rule says how to split what feeds `down`
            inner = ops.rmsnorm(ops.linear(h, self.up), self.norm, eps=1e-6)
        h = ops.add(h, ops.linear(inner, self.down))
        return ops.linear(ops.index_select(h, rows), self.head, role="lm_head")


def _sharded(mlp: str, rank: int = 0) -> object:
    graph, _ = trace(TinyLM(mlp))
    for spec in graph.weights.values():
        spec.dtype = "float32"
    options = CompileOptions(tp=TensorParallel(2, rank))
    return run_passes(graph, options, [shard])[0]


@pytest.mark.parametrize("mlp", ["gated", "plain"])
def test_any_mlp_of_elementwise_ops_between_linears_is_split(mlp: str) -> None:
    g = _sharded(mlp)
    shapes = {name: spec.shape for name, spec in g.weights.items()}
    assert shapes["up"] == (WIDTH // 2, HIDDEN) and shapes["down"] == (HIDDEN, WIDTH // 2)
    if mlp == "gated":
        assert shapes["gate"] == (WIDTH // 2, HIDDEN)
    assert shapes["lm_head.weight"] == (VOCAB // 2, HIDDEN)
    assert g.count("all_reduce") == 2 and g.count("all_gather") == 1  # down, embedding


def test_a_linear_no_rule_covers_stops_the_compile_naming_it() -> None:
    with pytest.raises(PassError, match=r"%v\d+: --tp-size 2: no tensor-parallel rule"):
        _sharded("normed")


def test_a_pass_reads_only_the_options_it_declares() -> None:
    @compiler_pass("tp")
    def peeks(graph, options):
        assert options.tp.size == 1
        _ = options.quantization  # not declared
        return PassResult(graph, False)

    graph, _ = trace(TinyLM("plain"))
    with pytest.raises(AttributeError, match="pass peeks reads .*'quantization' without declar"):
        run_passes(graph, CompileOptions(), [peeks])
    with pytest.raises(ValueError, match="no compile options"):
        compiler_pass("tpp")


def test_options_are_frozen_and_per_rank_copies_are_new_objects() -> None:
    options = CompileOptions(tp=TensorParallel(4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = "float16"  # type: ignore[misc]
    assert options.for_rank(3).tp.rank == 3 and options.tp.rank == 0


def test_every_pass_of_the_pipeline_declares_what_it_reads() -> None:
    for p in PIPELINE:
        assert hasattr(p, "reads"), p.__name__
