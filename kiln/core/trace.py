"""Tracing: run a model definition on symbolic values and record kiln ops into a Graph.

Model definitions are ordinary `torch.nn.Module`s built on the meta device; their
parameters carry the checkpoint's names and shapes but no data. Their `forward` calls the
op front-ends in `kiln.core.ops`, which append nodes to the active tracer's graph.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kiln.core.ir import GRAPH_INPUTS, Graph, IRError, Node, WeightSpec
from kiln.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


class Value:
    """A symbolic tensor during tracing: a handle on the node that produces it."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    def __repr__(self) -> str:
        return f"Value(%{self.node.name})"


_ACTIVE: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("kiln_tracer", default=None)


class Tracer:
    def __init__(self, module: torch.nn.Module) -> None:
        self.graph = Graph()
        self.constants: dict[str, torch.Tensor] = {}
        self._param_names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        self._param_nodes: dict[str, Node] = {}

    def _load(self, weight: torch.Tensor) -> tuple[str, dict[str, Any]]:
        """A module parameter's checkpoint name and the recipe that loads it whole."""
        name = self._param_names.get(id(weight))
        if name is None:
            raise IRError("a parameter that does not belong to the traced module")
        return name, {"load": name, "shape": list(weight.shape)}

    def emit(self, op: str, args: list[Any], attrs: dict[str, Any] | None = None) -> Node:
        return self.graph.add(op, [self.as_node(a) for a in args], attrs)

    def as_node(self, x: Any) -> Node:
        if isinstance(x, Value):
            return x.node
        if isinstance(x, torch.nn.Parameter):
            name, source = self._load(x)
            return self._param(name, tuple(x.shape), _dtype_name(x.dtype), source)
        raise IRError(f"cannot trace a {type(x).__name__} as an op argument")

    def shifted(self, weight: torch.nn.Parameter, by: float) -> Value:
        """A checkpoint weight plus `by`, added once at compile time (Gemma's norms scale
        by 1 + w): the artefact stores the sum under the weight's own name."""
        name, load = self._load(weight)
        source = {"shift": load, "by": by}
        return Value(self._param(name, tuple(weight.shape), _dtype_name(weight.dtype), source))

    def rows(
        self,
        weight: torch.Tensor,
        part: str,
        start: int,
        stop: int,
        rotary: tuple[int, int],
        interleaved: bool = False,
    ) -> Value:
        """Rows [start, stop) of a fused checkpoint weight (Phi-3's qkv_proj, gate_up_proj),
        cut at compile time and named as module `part` would name its own weight. With
        `rotary` (head_dim, rotary_dim) != (0, 0), each head's rows (of a weight or a bias)
        are put in kiln.core.recipes.rotary_order, its rope pairs `interleaved` or not."""
        name, source = self._load(weight)
        full = list(weight.shape)
        if (start, stop) != (0, full[0]):
            source = {"slice": source, "dim": 0, "start": start, "stop": stop}
        source = _in_rotary_order(source, rotary, interleaved)
        modules = name.split(".")
        modules[-2] = part
        shape = (stop - start, *full[1:])
        return Value(self._param(".".join(modules), shape, _dtype_name(weight.dtype), source))

    def joined(
        self,
        weights: list[torch.Tensor],
        part: str,
        rotary: tuple[int, int] = (0, 0),
        interleaved: bool = False,
    ) -> Value:
        """Checkpoint weights flattened and joined end to end as one 1-D weight, named as
        module `part` (a module the first weight is in) would name its own (per-head norm
        weights: StableLM's `q_layernorm.norms.<h>.weight` one a head become
        `q_layernorm.weight`; Cohere's [heads, dim] `q_norm.weight` keeps its name); with
        `rotary` (head_dim, rotary_dim) != (0, 0), each head's features in rotary_order."""
        names = [self._load(w) for w in weights]
        modules = names[0][0].split(".")
        if part not in modules[:-1]:
            raise IRError(f"{names[0][0]}: not a weight of a module named {part!r}")
        name = ".".join([*modules[: modules.index(part) + 1], "weight"])
        loads = [load for _, load in names]
        size = sum(w.numel() for w in weights)
        source = _in_rotary_order({"join": loads, "shape": [size]}, rotary, interleaved)
        return Value(self._param(name, (size,), _dtype_name(weights[0].dtype), source))

    def head_parts(
        self, weight: torch.Tensor, heads: int, parts: tuple[int, ...], deinterleave: bool
    ) -> Value:
        """A checkpoint weight whose rows are per head [part 0 | part 1 | ...], stored as
        [part 0 of every head | part 1 of every head | ...], the last part's rows taken
        evens first, then odds, with `deinterleave` (DeepSeek's q and latent projections)."""
        name, load = self._load(weight)
        shape = list(weight.shape)
        if shape[0] != heads * sum(parts):
            raise IRError(f"{name}: {shape[0]} rows are not {heads} heads of {parts}")
        source = {
            "head_parts": load,
            "heads": heads,
            "parts": list(parts),
            "deinterleave": deinterleave,
        }
        return Value(self._param(name, tuple(shape), _dtype_name(weight.dtype), source))

    def expert_part(
        self,
        weight: torch.Tensor,
        part: str,
        index: int,
        take: tuple[int, int] = (0, 1),
        transpose: bool = False,
        rows: tuple[int, int] | None = None,
    ) -> Value:
        """Expert `index` of a stacked [experts, ...] checkpoint tensor, as weight
        `<tensor>.<index>.<part>`: of its last dimension every take[1]-th element from
        take[0], transposed if asked (GPT-OSS's experts), then rows [rows[0], rows[1]) if
        given (Granite MoE's gate and up halves), cut at compile time."""
        whole, load = self._load(weight)
        shape = list(weight.shape)[1:]
        shape[-1] = len(range(take[0], shape[-1], take[1]))
        if transpose:
            shape = [shape[1], shape[0], *shape[2:]]
        source: dict[str, Any] = {
            "expert": load,
            "index": index,
            "take": list(take),
            "transpose": transpose,
        }
        if rows is not None:
            source = {"slice": source, "dim": 0, "start": rows[0], "stop": rows[1]}
            shape[0] = rows[1] - rows[0]
        name = f"{whole}.{index}.{part}"
        return Value(self._param(name, tuple(shape), _dtype_name(weight.dtype), source))

    def constant(self, name: str, value: torch.Tensor) -> Value:
        """A tensor computed by the model definition, stored in the artefact as a weight."""
        self.constants[name] = value
        return Value(
            self._param(name, tuple(value.shape), _dtype_name(value.dtype), {"constant": name})
        )

    def _param(self, name: str, shape: tuple[int, ...], dtype: str, source: dict) -> Node:
        node = self._param_nodes.get(name)
        if node is None:
            self.graph.weights[name] = WeightSpec(shape, dtype, source)
            node = self.graph.add("param", attrs={"name": name})
            self._param_nodes[name] = node
        return node


def _in_rotary_order(
    source: dict[str, Any], rotary: tuple[int, int], interleaved: bool
) -> dict[str, Any]:
    """`source`'s rows with each head's in kiln.core.recipes.rotary_order for `rotary`
    (head_dim, rotary_dim); (0, 0): as they are."""
    if rotary == (0, 0):
        return source
    out = {"rotary_order": source, "head_dim": rotary[0], "rotary_dim": rotary[1]}
    return {**out, "interleaved": True} if interleaved else out


def active_tracer() -> Tracer:
    tracer = _ACTIVE.get()
    if tracer is None:
        raise RuntimeError("kiln ops only run under kiln.core.trace.trace()")
    return tracer


@contextmanager
def _activate(tracer: Tracer) -> Iterator[None]:
    token = _ACTIVE.set(tracer)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def trace(module: torch.nn.Module) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Trace `module.forward(input_ids, positions, logits_indices)` into a graph.

    Returns the graph and the constants the definition computed (keyed by weight name).
    Param nodes are placed first, in first-use order, so the printout reads top-down.
    """
    tracer = Tracer(module)
    inputs = [Value(tracer.graph.add("input", attrs={"name": n}, name=n)) for n in GRAPH_INPUTS]
    with _activate(tracer), torch.no_grad():
        out = module(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    tracer.graph.add("output", [tracer.as_node(o) for o in outs], name="output")
    graph = tracer.graph
    graph.nodes.sort(key=lambda n: {"input": 0, "param": 1}.get(n.op, 2))
    return graph, tracer.constants


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
