"""The ops that carry the graph rather than compute: its inputs, its weights, its output,
and picking one value of a multi-output op. The executor runs them itself (no kernel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.ir import GRAPH_INPUTS
from kiln.core.opdef import Attrs, Check, Input, NoAttrs, OpDef, TensorType, op


@dataclass(frozen=True, slots=True)
class Named(Attrs):
    name: str


@dataclass(frozen=True, slots=True)
class Index(Attrs):
    index: int


def _input(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    if a["name"] not in GRAPH_INPUTS:
        raise check.fail(f"unknown graph input {a['name']!r}")
    return TensorType(None, "int64")  # token ids, positions, logits rows


def _param(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    spec = check.graph.weights.get(a["name"])
    if spec is None:
        raise check.fail(f"param {a['name']!r} has no weight spec")
    check.positive(**{f"dim {i}": d for i, d in enumerate(spec.shape)})
    return TensorType(spec.shape[-1] if spec.shape else None, spec.dtype)


def _output(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    return tuple(ins)


def _getitem(check: Check, a: dict[str, Any], ins: list[Any]) -> Any:
    parts = ins[0]
    if not isinstance(parts, tuple) or not 0 <= a["index"] < len(parts):
        raise check.fail(f"getitem index {a['index']} is out of range")
    return parts[a["index"]]


def _structural(name: str, inputs: str, attrs: type[Attrs], rule: Any) -> OpDef:
    """An op with no kernel at all (the executor binds inputs and weights, and returns)."""
    return OpDef(name, [Input.parse(x) for x in inputs.split(",") if x.strip()], attrs, rule, None)


input_ = _structural("input", "", Named, _input)
param = _structural("param", "", Named, _param)
output = _structural("output", "x, *rest", NoAttrs, _output)


@op("x", Index, rule=_getitem)
def getitem(x: Any, *, a: Index) -> Any:
    return x[a.index]


STRUCTURAL: tuple[OpDef, ...] = (input_, param, output, getitem)
# The names the executor handles itself.
STRUCTURAL_OPS = frozenset(d.name for d in STRUCTURAL)
