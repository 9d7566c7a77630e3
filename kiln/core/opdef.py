"""How an op is defined, once: `OpDef` holds its inputs, its typed attributes (a frozen
dataclass kernels receive as `a`), its outputs, its type rule (feature size and dtype of
what it returns, checked against what it is given) and its reference kernel in torch. It
is also the op's tracing front-end: model definitions call it.

    @dataclass(frozen=True, slots=True)
    class Norm(Attrs):
        eps: float
        group: int = 0

    @op("x, weight", Norm, rule=_norm_rule)
    def rmsnorm(x, weight, *, a: Norm): ...        # the reference kernel

    h = rmsnorm(x, w, eps=1e-6)                     # in a model definition: traces a node

Backends register their kernels against the op by name (kernels/registry.py), with the
signature the definition implies: `([ctx,] *inputs, *, a[, lib])`; the registry refuses any
other at import, so no backend keeps a copy of an op's keyword list.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kiln.core.ir import Graph, IRError, Node
from kiln.core.trace import Value, active_tracer

# What a node may be to the model, recorded at trace time in `meta["role"]`: the token
# embedding and the lm_head (passes keep them float, shard them by vocabulary rows), a
# classifier's score head and Qwen2-MoE's shared-expert gate (kept float and whole).
ROLES = ("embedding", "lm_head", "score", "expert_gate")
# A weight or node name: what a "str" attribute may hold (no code, no path).
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,255}")


@dataclass(frozen=True, slots=True)
class Attrs:
    """Base of every op's attribute class. Field types say what a value may be: int,
    float (finite), int | None, list[int], a Literal of strings, or str (a name)."""


@dataclass(frozen=True, slots=True)
class NoAttrs(Attrs):
    """An op without attributes."""


@dataclass(frozen=True)
class TensorType:
    """What flows along an edge: the last dimension (`features`; None for per-token
    scalars such as ids and positions) and the element type. `rope` marks the rotary
    tables (cos, sin), one value of `features` rotary dims."""

    features: int | None
    dtype: str
    kind: Literal["tensor", "rope"] = "tensor"

    def __str__(self) -> str:
        feats = "scalar" if self.features is None else self.features
        return (
            f"{self.kind} of {feats} {self.dtype}"
            if self.kind != "tensor"
            else f"{feats} {self.dtype}"
        )


# A value's type: one TensorType, or a tuple of them for an op with several outputs.
Type = TensorType | tuple[Any, ...]
FLOATS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Input:
    name: str
    optional: bool = False  # may be left out, from the end
    variadic: bool = False  # any number, last

    @classmethod
    def parse(cls, text: str) -> Input:
        name = text.strip()
        if name.startswith("*"):
            return cls(name[1:], variadic=True)
        if name.endswith("?"):
            return cls(name[:-1], optional=True)
        return cls(name)


class Check:
    """What a type rule is given: the node, the graph (weights' shapes and layouts) and
    helpers that raise IRError naming the node."""

    def __init__(self, graph: Graph, node: Node) -> None:
        self.graph, self.node = graph, node

    def fail(self, message: str) -> IRError:
        return IRError(f"%{self.node.name}: {message}")

    def expect(self, what: str, got: object, want: object) -> None:
        if got != want:
            raise self.fail(f"{self.node.op} {what} is {got}, expected {want}")

    def positive(self, **values: object) -> None:
        for name, v in values.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise self.fail(f"{self.node.op} {name} must be a positive integer, got {v!r}")

    def weight(self, index: int, dims: int) -> tuple[int, ...]:
        """The shape of input `index`, which must be a `dims`-D weight."""
        arg = self.node.args[index]
        spec = self.graph.weight_of(arg)
        if spec is None:
            raise IRError(f"%{arg.name}: expected a weight, got a computed value")
        if len(spec.shape) != dims:
            raise IRError(f"%{arg.name}: weight {arg.attrs['name']!r} must be {dims}-D")
        return spec.shape

    def float_tensor(self, t: Any, what: str = "input") -> TensorType:
        if not isinstance(t, TensorType) or t.kind != "tensor" or t.dtype not in FLOATS:
            raise self.fail(f"{self.node.op} {what} must be a float tensor, got {t}")
        return t

    def ids(self, t: Any, what: str = "ids") -> None:
        if not isinstance(t, TensorType) or t.dtype != "int64" or t.features is not None:
            raise self.fail(f"{self.node.op} {what} must be int64 per-token values, got {t}")

    def same_dtype(self, *types_: Any) -> str:
        dtypes = {t.dtype for t in types_}
        if len(dtypes) != 1:
            raise self.fail(f"{self.node.op} mixes element types {sorted(dtypes)}")
        return dtypes.pop()


Rule = Callable[[Check, Any, list[Any]], Any]  # (check, attrs, input types) -> output type


class OpDef:
    """One op: see the module docstring. `outputs` is the number of values it returns
    (-1: as many as its `sizes` attribute has); `needs_ctx`: its kernels read the step's
    attention context (the KV pool) as their first argument; `panels`: it reads weights
    stored as panels (kiln/core/layout.py), which no other op may."""

    def __init__(
        self,
        name: str,
        inputs: Sequence[Input],
        attrs: type[Attrs],
        rule: Rule,
        reference: Callable[..., Any] | None,
        outputs: int = 1,
        needs_ctx: bool = False,
        panels: bool = False,
        front: Callable[..., Any] | None = None,
    ) -> None:
        self.name, self.inputs, self.attrs, self.rule = name, tuple(inputs), attrs, rule
        self.reference, self.outputs = reference, outputs
        self.needs_ctx, self.panels, self._front = needs_ctx, panels, front
        self.fields: tuple[tuple[str, str, Any], ...] = _fields(attrs)

    def __repr__(self) -> str:
        return f"<op {self.name}>"

    @property
    def kernel(self) -> Callable[..., Any]:
        """The reference kernel (every compute op has one; the structural ops have none)."""
        if self.reference is None:
            raise TypeError(f"{self.name} is run by the executor itself, not by a kernel")
        return self.reference

    # -- schema ---------------------------------------------------------------------------
    @property
    def attr_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.fields)

    @property
    def min_args(self) -> int:
        return sum(1 for i in self.inputs if not (i.optional or i.variadic))

    @property
    def max_args(self) -> int | None:
        if any(i.variadic for i in self.inputs):
            return None
        return len(self.inputs)

    def check_attr(self, name: str, value: Any) -> Any:
        """`value` as attribute `name` holds it; IRError (naming it) if it may not."""
        kind = next(k for n, k, _ in self.fields if n == name)
        return _checked(name, kind, value)

    def bind(self, attrs: dict[str, Any]) -> Attrs:
        """The attribute object kernels receive for a node's attrs."""
        return self.attrs(**attrs)

    # -- tracing --------------------------------------------------------------------------
    def __call__(self, *args: Any, role: str | None = None, **attrs: Any) -> Any:
        """Trace the op into the active graph (model definitions call this). `role` marks
        what the node is to the model ("embedding", "lm_head"), so that passes know it from
        the graph rather than from checkpoint names."""
        if self._front is not None:
            return self._front(self, *args, **attrs)
        return self.emit(list(args), attrs, role)

    def emit(self, args: list[Any], attrs: dict[str, Any], role: str | None = None) -> Any:
        """Record the node with `attrs` filled from the defaults; returns its Value, or one
        Value per output."""
        while args and args[-1] is None and len(args) > self.min_args:
            args = args[:-1]  # an optional input left out (a linear without bias)
        unknown = sorted(set(attrs) - set(self.attr_names))
        if unknown:
            raise TypeError(f"{self.name} has no attribute {', '.join(unknown)}")
        full = {}
        for name, _, default in self.fields:
            if name not in attrs and default is dataclasses.MISSING:
                raise TypeError(f"{self.name} needs attribute {name}")
            full[name] = attrs.get(name, default)
        if role is not None and role not in ROLES:
            raise TypeError(f"role {role!r}: one of {', '.join(ROLES)}")
        tracer = active_tracer()
        node = tracer.emit(self.name, args, full)
        if role is not None:
            node.meta["role"] = role
        count = len(full["sizes"]) if self.outputs == -1 else self.outputs
        if count == 1:
            return Value(node)
        return tuple(
            Value(tracer.emit("getitem", [Value(node)], {"index": i})) for i in range(count)
        )

    # -- types ----------------------------------------------------------------------------
    def infer(self, graph: Graph, node: Node, ins: list[Any]) -> Any:
        """The node's output type from its inputs'; IRError naming the node if they do not
        fit (a panel weight read by an op that cannot read panels included)."""
        check = Check(graph, node)
        for name in self.attr_names:
            try:
                self.check_attr(name, node.attrs[name])
            except IRError as e:
                raise check.fail(str(e)) from None
        if not self.panels:
            for arg in node.args:
                spec = graph.weight_of(arg)
                if spec is not None and spec.layout != "rows":
                    raise check.fail(f"{node.op} cannot read a weight stored as panels")
        return self.rule(check, node.attrs, ins)


def op(
    inputs: str,
    attrs: type[Attrs] = NoAttrs,
    *,
    rule: Rule,
    outputs: int = 1,
    needs_ctx: bool = False,
    panels: bool = False,
    front: Callable[..., Any] | None = None,
    name: str | None = None,
) -> Callable[[Callable[..., Any]], OpDef]:
    """Define an op from its reference kernel (the decorated function; its name is the
    op's unless `name` says otherwise). `inputs`: comma-separated names, `name?` optional,
    `*name` variadic."""

    def define(reference: Callable[..., Any]) -> OpDef:
        parsed = [Input.parse(x) for x in inputs.split(",") if x.strip()]
        return OpDef(
            name or reference.__name__,
            parsed,
            attrs,
            rule,
            reference,
            outputs,
            needs_ctx,
            panels,
            front,
        )

    return define


def signature_problem(definition: OpDef, fn: Callable[..., Any], native: bool) -> str | None:
    """Why `fn` cannot be a kernel of `definition`, or None: it must take the step context
    (`ctx`) first when the op needs it, then the op's inputs by name, then keyword-only the
    attribute object `a` (when the op has attributes) and `lib` (native kernels)."""
    params = list(inspect.signature(fn).parameters.values())
    want: list[tuple[str, Any]] = []
    if definition.needs_ctx:
        want.append(("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD))
    for i in definition.inputs:
        kind = (
            inspect.Parameter.VAR_POSITIONAL
            if i.variadic
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        want.append((i.name, kind))
    if definition.fields:
        want.append(("a", inspect.Parameter.KEYWORD_ONLY))
    if native:
        want.append(("lib", inspect.Parameter.KEYWORD_ONLY))
    got = [(p.name, p.kind) for p in params]
    if got != want:
        return f"takes ({_show(got)}), the op's kernels take ({_show(want)})"
    for p, i in zip(params[1 if definition.needs_ctx else 0 :], definition.inputs, strict=False):
        if i.optional and p.default is inspect.Parameter.empty:
            return f"must default optional input {i.name} to None"
    return None


def _show(params: list[tuple[str, Any]]) -> str:
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.KEYWORD_ONLY: "kw "}
    return ", ".join(f"{marks.get(kind, '')}{name}" for name, kind in params)


# -- attribute kinds ----------------------------------------------------------------------
def _fields(cls: type[Attrs]) -> tuple[tuple[str, str, Any], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append((f.name, _kind(hints[f.name]), default))
    return tuple(out)


def _kind(hint: Any) -> str:
    if hint is bool:
        raise TypeError("op attributes are ints, not bools (JSON tells them apart badly)")
    if hint in (int, float, str):
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and set(args) == {int, type(None)}:
        return "int?"
    if origin is list and args == (int,):
        return "ints"
    if origin is Literal and all(isinstance(a, str) for a in args):
        return "choice:" + "|".join(args)
    raise TypeError(f"op attributes cannot be of type {hint!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _checked(name: str, kind: str, v: Any) -> Any:
    if kind == "int" and _is_int(v):
        return v
    if kind == "int?" and (v is None or _is_int(v)):
        return v
    if kind == "float" and (_is_int(v) or isinstance(v, float)) and math.isfinite(v):
        return float(v)
    if kind == "ints" and isinstance(v, list) and all(_is_int(x) for x in v):
        return list(v)
    if kind == "str" and isinstance(v, str) and NAME.fullmatch(v):
        return v
    if kind.startswith("choice:") and v in kind[7:].split("|"):
        return v
    wanted = {
        "int": "an integer",
        "int?": "an integer or null",
        "float": "a finite number",
        "ints": "a list of integers",
        "str": "a name of letters, digits, '_', '.' and '-'",
    }.get(kind) or f"one of {', '.join(kind[7:].split('|'))}"
    text = repr(v)
    raise IRError(
        f"attr {name}: expected {wanted}, got {text if len(text) <= 60 else text[:57] + '...'}"
    )


def with_attrs(definition: OpDef, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a kernel of `definition`'s op) called as the kernel tests and benchmarks write
    it: tensors first, then the op's attributes by position or name (`rmsnorm(x, w, 1e-6,
    group=8)`), which become its attribute object (`a=Norm(eps=1e-6, group=8)`)."""

    def call(*args: Any, **kw: Any) -> Any:
        import torch  # only callers that run kernels get here

        lead = 1 if definition.needs_ctx else 0
        fixed = [i for i in definition.inputs if not i.variadic]
        n = lead
        while n < len(args) and n - lead < len(fixed):
            if not (isinstance(args[n], (torch.Tensor, tuple)) or args[n] is None):
                break
            n += 1
        names = [f for f in definition.attr_names if f not in kw]
        attrs = {**dict(zip(names, args[n:], strict=False)), **kw}
        if not definition.attr_names:
            return fn(*args[:n])
        defaults = {name: d for name, _, d in definition.fields if d is not dataclasses.MISSING}
        return fn(*args[:n], a=definition.attrs(**{**defaults, **attrs}))

    return call
