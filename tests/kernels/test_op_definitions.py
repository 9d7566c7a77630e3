"""Every op is defined once and completely, and every kernel fits its op's definition."""

from __future__ import annotations

import inspect

import pytest
import torch

from kiln.core.opdef import OpDef, signature_problem
from kiln.core.ops import OPS, STRUCTURAL_OPS
from kiln.kernels import catalog
from kiln.kernels.registry import register

COMPUTE = sorted(set(OPS) - STRUCTURAL_OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_an_op_has_a_schema_and_a_type_rule(name: str) -> None:
    d = OPS[name]
    assert isinstance(d, OpDef) and d.name == name
    assert callable(d.rule)
    assert all(i.name.isidentifier() for i in d.inputs)
    assert d.inputs or name in ("input", "param")  # graph inputs and weights take none
    assert d.outputs == -1 or d.outputs >= 1
    # Attribute kinds come from the attribute class's annotations, defaults included.
    assert [f for f, _, _ in d.fields] == list(d.attr_names)


@pytest.mark.parametrize("name", COMPUTE)
def test_a_compute_op_has_a_reference_kernel_that_is_its_torch_native_kernel(name: str) -> None:
    d = OPS[name]
    assert d.reference is not None and inspect.isfunction(d.reference)
    kernel = catalog.get(name, "torch_native")
    assert kernel.fn is d.reference and kernel.op is d
    assert signature_problem(d, d.reference, native=False) is None


@pytest.mark.parametrize("kernel", catalog.kernels(), ids=lambda k: f"{k.op.name}-{k.backend}")
def test_every_registered_kernel_takes_what_its_op_gives(kernel) -> None:
    assert signature_problem(kernel.op, kernel.fn, kernel.native) is None


def test_a_kernel_with_its_own_keyword_list_is_refused() -> None:
    """The kind of copy the op definitions replace: attention's attributes as keywords."""

    def attention(ctx, q, k, v, *, layer, num_heads, num_kv_heads, head_dim, scale, lib):
        return q

    with pytest.raises(TypeError, match="kiln_cpu kernel of attention .* takes"):
        register("attention", "kiln_cpu", native=True)(attention)

    def rmsnorm(x, w, *, a, lib):  # the op's second input is `weight`
        return x

    with pytest.raises(TypeError, match="weight"):
        register("rmsnorm", "kiln_cpu", native=True)(rmsnorm)
    assert catalog.get("attention", "kiln_cpu").fn.__module__ == "kiln.kernels.cpu"


def test_tracing_fills_defaults_and_refuses_unknown_attributes() -> None:
    from kiln.core import ops
    from kiln.core.trace import trace

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(8, device="meta"), requires_grad=False)

        def forward(self, ids, positions, rows):
            return ops.rmsnorm(ids, self.w, eps=1e-6)

    graph, _ = trace(Model())
    [norm] = [n for n in graph.nodes if n.op == "rmsnorm"]
    assert norm.attrs == {"eps": 1e-6, "group": 0}

    class Bad(Model):
        def forward(self, ids, positions, rows):
            return ops.rmsnorm(ids, self.w, eps=1e-6, grup=4)

    with pytest.raises(TypeError, match="rmsnorm has no attribute grup"):
        trace(Bad())
