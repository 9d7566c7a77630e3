"""The runtime runs what the graph says: an op that attends records a decode kernel and a
prefill kernel, the executor makes one function per phase, and no kernel hands a step it
was not chosen for to another implementation."""

from __future__ import annotations

import pytest
import torch

from kiln.core.ops.attention import Attention, AttentionBatch, SeqSpan
from kiln.kernels import catalog
from kiln.kernels.cpu import KernelError
from kiln.runtime.artefact import Artefact
from kiln.runtime.executor import Executor


def test_a_kiln_cpu_artefact_runs_two_phases(artefact) -> None:
    art = Artefact.open(artefact("llama"))
    attn = next(n for n in art.graph.nodes if n.op == "rope_attention")
    assert (attn.meta["backend"], attn.meta["prefill_backend"]) == ("kiln_cpu", "torch_native")
    ex = Executor(art.graph, art.weights, art.lib)
    assert ex.prefill is not ex.decode and ex.prefill.source == ex.decode.source


def test_an_artefact_of_one_kernel_per_op_runs_one_function(artefact) -> None:
    art = Artefact.open(artefact("llama", compile_args={"attention_backend": "torch_native"}))
    ex = Executor(art.graph, art.weights, art.lib)
    assert ex.prefill is ex.decode


def test_kiln_cpu_attention_refuses_a_prefill_step(artefact) -> None:
    """It used to send prefills to SDPA itself; now the graph names the prefill kernel."""
    lib = Artefact.open(artefact("llama")).lib
    kc, vc = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    batch = AttentionBatch.build(kc, vc, [SeqSpan(0, 3, 3, torch.arange(3))])
    a = Attention(0, 4, 2, 8, 8**-0.5, None)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    fn = catalog.get("attention", "kiln_cpu").fn
    with pytest.raises(KernelError, match="decode steps only"):
        fn(batch, q, k, k, a=a, lib=lib)
    assert catalog.get("attention", "kiln_cpu").phases == ("decode",)
