"""The kiln graph IR: a straight-line list of nodes over a small, fixed op vocabulary (the
ops of kiln/core/ops, each defined once; kiln/core/check.py holds a graph to them).

A node names its tensor inputs (`args`, other nodes), its static attributes (`attrs`,
JSON-serialisable) and free-form pass notes (`meta`, e.g. the kernel backend chosen).
Weights are `param` nodes that refer to an entry of `Graph.weights` by name; the tensor
bytes live outside the graph (in the checkpoint at compile time, in the artefact after).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.core.layout import stored_shape

# How the capture plan (passes/capture_plan.py) may run each kind of step.
CAPTURE_MODES = {
    "decode": ("cuda_graph", "compiled", "native", "eager"),
    "prefill": ("piecewise", "native", "eager"),
}

# Runtime-provided graph inputs, in the order the executor passes them.
GRAPH_INPUTS = ("input_ids", "positions", "logits_indices")


class IRError(ValueError):
    """The graph breaks an IR invariant; the message names the node."""


@dataclass(eq=False)
class Node:
    name: str
    op: str
    args: list[Node] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"%{self.name}"

    def format(self) -> str:
        args = ", ".join(f"%{a.name}" for a in self.args)
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.attrs.items())
        inner = ", ".join(x for x in (args, attrs) if x)
        backend = f"  # {self.meta['backend']}" if "backend" in self.meta else ""
        return f"%{self.name} = {self.op}({inner}){backend}"


@dataclass
class WeightSpec:
    """Shape and dtype of a weight, and how the compiler materialises it (`source`).

    `source` is a small recipe tree: {"load": hf_name}, {"concat": [recipes], "dim": 0},
    {"join": [recipes], "shape"} (each flattened, joined end to end: per-head norm weights),
    {"shift": recipe, "by": x} (the recipe's tensor plus x),
    {"constant": key} for tensors computed by the model definition (e.g. rope frequencies),
    {"slice": recipe, "dim", "start", "stop"} (a rank's part, a fused weight's rows),
    {"rotary_order": recipe, ...} and {"head_parts": recipe, ...} (rows reordered per head),
    {"expert": recipe, "index", ...} (one expert of a stacked tensor), {"mla_absorb": recipe,
    ...} (kv_b's halves per head), {"zeros": shape}; compiler/compile.py makes each.
    `shape` is the logical shape; `layout` how the artefact stores it: "rows" (as is) or
    "panels{L}x{G}" (a kiln_cpu linear's weight, see kernels/native.py `stored_shape`).
    """

    shape: tuple[int, ...]
    dtype: str
    source: dict[str, Any]
    layout: str = "rows"

    def to_json(self) -> dict[str, Any]:
        d = {"shape": list(self.shape), "dtype": self.dtype, "source": self.source}
        return d if self.layout == "rows" else {**d, "layout": self.layout}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WeightSpec:
        return cls(tuple(d["shape"]), d["dtype"], d["source"], d.get("layout", "rows"))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the artefact holds for this weight."""
        return stored_shape(self.shape, self.layout)


class Graph:
    """An ordered node list (topological by construction) plus the weight table."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.weights: dict[str, WeightSpec] = {}
        # The capture plan (passes/capture_plan.py): static shapes a step may run at.
        self.plan: dict[str, Any] | None = None
        # The longest sequence the model takes (its max_position_embeddings), recorded at
        # trace time; the runtime holds the manifest's context_length to it.
        self.context_length: int | None = None
        self._names: set[str] = set()
        self._counter = 0

    # -- building -----------------------------------------------------------------------
    def fresh_name(self, hint: str = "v") -> str:
        while True:
            self._counter += 1
            name = f"{hint}{self._counter}"
            if name not in self._names:
                return name

    def add(
        self,
        op: str,
        args: list[Node] | None = None,
        attrs: dict[str, Any] | None = None,
        name: str | None = None,
        before: Node | None = None,
    ) -> Node:
        """Create a node; appended, or inserted just before `before` when given."""
        node = Node(name or self.fresh_name(), op, list(args or []), dict(attrs or {}))
        if node.name in self._names:
            raise IRError(f"duplicate node name %{node.name}")
        self._names.add(node.name)
        if before is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(self.nodes.index(before), node)
        return node

    def param(self, weight: str, before: Node | None = None) -> Node:
        """The param node of `weight`, created if the graph has none yet."""
        for n in self.nodes:
            if n.op == "param" and n.attrs["name"] == weight:
                return n
        anchor = before
        if anchor is None:
            anchor = next((n for n in self.nodes if n.op not in ("input", "param")), None)
        return self.add("param", attrs={"name": weight}, before=anchor)

    def remove(self, node: Node) -> None:
        self.nodes.remove(node)
        self._names.discard(node.name)

    # -- queries ------------------------------------------------------------------------
    def users(self) -> dict[Node, list[Node]]:
        users: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for a in n.args:
                users.setdefault(a, []).append(n)
        return users

    def replace_all_uses(self, old: Node, new: Node) -> None:
        for n in self.nodes:
            n.args = [new if a is old else a for a in n.args]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    def weight_of(self, node: Node) -> WeightSpec | None:
        return self.weights.get(node.attrs["name"]) if node.op == "param" else None

    def count(self, op: str) -> int:
        return sum(1 for n in self.nodes if n.op == op)

    # -- printing and serialisation -------------------------------------------------------
    def format(self) -> str:
        return "\n".join(n.format() for n in self.nodes)

    def __str__(self) -> str:
        return self.format()

    def to_json(self) -> dict[str, Any]:
        plan = {} if self.plan is None else {"capture_plan": self.plan}
        ctx = {} if self.context_length is None else {"context_length": self.context_length}
        return {
            **ctx,
            **plan,
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op,
                    "args": [a.name for a in n.args],
                    "attrs": n.attrs,
                    "meta": n.meta,
                }
                for n in self.nodes
            ],
            "weights": {k: w.to_json() for k, w in self.weights.items()},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)
