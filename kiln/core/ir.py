"""The kiln graph IR: a straight-line list of nodes over a small, fixed op vocabulary.

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

# Attribute kinds an op schema can name; what each admits is checked by
# `kiln.compiler.graph_check` when a graph is read from a file.
AttrKind = str  # "int" | "float" | "int?" | "ints" | "str"


@dataclass(frozen=True)
class OpSchema:
    """Arity and typed attributes of an op. `max_args=None` means variadic."""

    min_args: int
    max_args: int | None
    attrs: tuple[tuple[str, AttrKind], ...] = ()
    outputs: int = 1

    @property
    def attr_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.attrs)


_ATTENTION_ATTRS = (
    ("layer", "int"),
    ("num_heads", "int"),
    ("num_kv_heads", "int"),
    ("head_dim", "int"),
    ("scale", "float"),
    ("sliding_window", "int?"),
    # An fp8 KV pool stores K/V / kv_scale (passes/kv_cache.py); 1.0 otherwise.
    ("kv_scale", "float"),
)

OPS: dict[str, OpSchema] = {
    "input": OpSchema(0, 0, (("name", "str"),)),
    "param": OpSchema(0, 0, (("name", "str"),)),
    "output": OpSchema(1, None),
    "getitem": OpSchema(1, 1, (("index", "int"),)),
    "embedding": OpSchema(2, 2),
    "linear": OpSchema(2, 3),
    # A linear whose weight the layout pass stored as panels (kiln/core/layout.py); row counts
    # in `narrow_rows` ([lo, hi]) take the narrow micro-kernel, others the wide one (decided
    # at compile). `prologue`, here and on quant_linear: "none", or "silu_and_mul" for an
    # input of twice the features, silu(x1) * x2 taken in the same call
    # (passes/fuse_silu_linear.py).
    "packed_linear": OpSchema(
        2, 3, (("out_features", "int"), ("narrow_rows", "ints"), ("prologue", "str"))
    ),
    # An embedding that reads its table from the panels of the tied lm_head.
    "packed_embedding": OpSchema(2, 2),
    # Linear and embedding on quantized weights (kiln/core/quant.py): args codes, scales
    # (and a bias), stored as q8/q4 panels and spanels by the quantize pass.
    "quant_linear": OpSchema(
        3, 4, (("format", "str"), ("group", "int"), ("out_features", "int"), ("prologue", "str"))
    ),
    "quant_embedding": OpSchema(
        3, 3, (("format", "str"), ("group", "int"), ("num_embeddings", "int"))
    ),
    "rmsnorm": OpSchema(2, 2, (("eps", "float"), ("group", "int"))),
    "add_rmsnorm": OpSchema(3, 3, (("eps", "float"),), outputs=2),
    "add": OpSchema(2, 2),
    "mul": OpSchema(2, 2),
    "silu": OpSchema(1, 1),
    "silu_and_mul": OpSchema(1, 1),
    "split": OpSchema(1, 1, (("sizes", "ints"),), outputs=-1),
    "rope_cos_sin": OpSchema(2, 2),
    "rope": OpSchema(2, 2, (("head_dim", "int"),)),
    # The fused q/k/v projection's output [q | k | v] -> (rope(q), rope(k), v): one rotary
    # call over the q and k heads together, v a view (passes/fuse_rope.py).
    "rope_qkv": OpSchema(2, 2, (("head_dim", "int"), ("sizes", "ints")), outputs=3),
    "attention": OpSchema(3, 3, _ATTENTION_ATTRS),
    # rope_qkv and attention in one op: args the fused projection's rows [q | k | v] and the
    # rotary tables (passes/fuse_rope.py); a decode step runs it as one native call.
    "rope_attention": OpSchema(2, 2, _ATTENTION_ATTRS),
    "index_select": OpSchema(2, 2),
    # A mixture-of-experts MLP: args x, the router [E, H], then each expert's gate, up and
    # down weights; each token runs its top_k experts by router softmax (renormalize: the
    # k weights scaled to sum to 1) and sums their outputs so weighted. An expert-parallel
    # rank holds experts [first_expert, first_expert + its weights / 3) and adds only theirs.
    "moe": OpSchema(
        5,
        None,
        (("num_experts", "int"), ("top_k", "int"), ("renormalize", "int"), ("first_expert", "int")),
    ),
    # Tensor parallelism (passes/shard.py): the sum of every rank's x, and every rank's x
    # side by side along the features (rank order).
    "all_reduce": OpSchema(1, 1, (("ranks", "int"),)),
    "all_gather": OpSchema(1, 1, (("ranks", "int"),)),
    # A vocabulary-parallel rank's embedding: rows [first_row, first_row + its rows) of the
    # table; ids outside them give zeros, and an all_reduce after it sums the ranks.
    "embedding_part": OpSchema(2, 2, (("first_row", "int"),)),
}

# The ops that attend over one layer's KV pool (their attrs are _ATTENTION_ATTRS).
ATTENTION_OPS = ("attention", "rope_attention")
# What a linear's `prologue` attr may say.
PROLOGUES = ("none", "silu_and_mul")

# How the capture plan (passes/capture_plan.py) may run each kind of step.
CAPTURE_MODES = {"decode": ("cuda_graph", "compiled", "eager"), "prefill": ("piecewise", "eager")}

# Ops the executor handles itself (no kernel, no backend).
STRUCTURAL_OPS = frozenset({"input", "param", "output", "getitem"})

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
    {"constant": key} for tensors computed by the model definition (e.g. rope frequencies).
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

    # -- invariants ---------------------------------------------------------------------
    def lint(self) -> None:
        """Raise IRError on the first broken invariant."""
        seen: set[int] = set()
        names: set[str] = set()
        params: set[str] = set()
        for i, n in enumerate(self.nodes):
            schema = OPS.get(n.op)
            if schema is None:
                raise IRError(f"%{n.name}: unknown op {n.op!r}")
            if n.name in names:
                raise IRError(f"%{n.name}: duplicate node name")
            names.add(n.name)
            nargs = len(n.args)
            if nargs < schema.min_args or (schema.max_args is not None and nargs > schema.max_args):
                raise IRError(
                    f"%{n.name}: {n.op} takes {schema.min_args}..{schema.max_args} "
                    f"args, got {nargs}"
                )
            missing = [a for a in schema.attr_names if a not in n.attrs]
            if missing:
                raise IRError(f"%{n.name}: {n.op} is missing attrs {missing}")
            for a in n.args:
                if id(a) not in seen:
                    raise IRError(f"%{n.name}: uses %{a.name} before it is defined")
                if a.op == "output":
                    raise IRError(f"%{n.name}: uses the output node")
                if OPS[a.op].outputs != 1 and n.op != "getitem":
                    raise IRError(f"%{n.name}: uses multi-output %{a.name} without getitem")
            if n.op == "param":
                wname = n.attrs["name"]
                if wname not in self.weights:
                    raise IRError(f"%{n.name}: param {wname!r} has no weight spec")
                if wname in params:
                    raise IRError(f"%{n.name}: second param node for {wname!r}")
                params.add(wname)
            if n.op == "input" and n.attrs["name"] not in GRAPH_INPUTS:
                raise IRError(f"%{n.name}: unknown graph input {n.attrs['name']!r}")
            if n.op == "output" and i != len(self.nodes) - 1:
                raise IRError(f"%{n.name}: output must be the last node")
            seen.add(id(n))
        if not self.nodes or self.nodes[-1].op != "output":
            raise IRError("graph has no output node")
        unused = set(self.weights) - params
        if unused:
            raise IRError(f"weights without a param node: {sorted(unused)[:5]}")

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
