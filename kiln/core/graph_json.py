"""Reading a graph from JSON: a strict decoder, because an artefact is untrusted input.

Every field is checked for type and form before a Node exists: node names are short
identifiers, ops come from the op table, attributes are exactly the op's attributes with
their declared kinds (finite numbers, ints that are not bools), indexes are ints, weight
names are dotted identifiers, shapes are lists of ints, and `meta` holds JSON scalars only.
Nothing here evaluates anything; the executor then builds its code from integers alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kiln.core.artefact import MAX_CONTEXT
from kiln.core.ir import CAPTURE_MODES, Graph, IRError, Node, WeightSpec
from kiln.core.layout import LAYOUT
from kiln.core.opdef import NAME
from kiln.core.ops import ATTENTION_OPS, HOST_SYNC_OPS, OPS

NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
WEIGHT_NAME = NAME
META_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
_NODE_KEYS = {"name", "op", "args", "attrs", "meta"}


def _fail(where: str, message: str) -> IRError:
    return IRError(f"{where}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _decode_node(i: int, nd: Any, by_name: dict[str, Node], graph: Graph) -> Node:
    where = f"node {i}"
    if not isinstance(nd, dict) or not {"name", "op", "args"} <= set(nd) or set(nd) - _NODE_KEYS:
        raise _fail(where, f"expected an object with keys {sorted(_NODE_KEYS)}")
    name = nd["name"]
    if not isinstance(name, str) or not NODE_NAME.fullmatch(name):
        raise _fail(where, f"node name must be an identifier, got {_show(name)}")
    where = f"node %{name}"
    if name in by_name:
        raise _fail(where, "duplicate node name")
    op = nd["op"]
    definition = OPS.get(op) if isinstance(op, str) else None
    if definition is None:
        raise _fail(where, f"unknown op {_show(op)}")
    args = nd["args"]
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise _fail(where, "args must be a list of node names")
    missing = [a for a in args if a not in by_name]
    if missing:
        raise _fail(where, f"unknown argument %{_show(missing[0])}")
    attrs = nd.get("attrs") or {}
    if not isinstance(attrs, dict):
        raise _fail(where, "attrs must be an object")
    if set(attrs) != set(definition.attr_names):
        raise _fail(
            where, f"{op} takes attrs {sorted(definition.attr_names)}, got {_show(sorted(attrs))}"
        )
    try:
        checked = {k: definition.check_attr(k, attrs[k]) for k in definition.attr_names}
    except IRError as e:
        raise _fail(where, str(e)) from None
    meta = nd.get("meta") or {}
    if not isinstance(meta, dict):
        raise _fail(where, "meta must be an object")
    for k, v in meta.items():
        if not META_KEY.fullmatch(k) or not (v is None or isinstance(v, str | int | float)):
            raise _fail(where, f"meta entry {_show(k)} must be a scalar under an identifier")
    node = graph.add(op, [by_name[a] for a in args], checked, name=name)
    node.meta = dict(meta)
    return node


def _decode_weight(name: Any, w: Any) -> WeightSpec:
    if not isinstance(name, str) or not WEIGHT_NAME.fullmatch(name):
        raise IRError(f"weight name {_show(name)} is not a dotted identifier")
    where = f"weight {name}"
    if not isinstance(w, dict):
        raise _fail(where, "expected an object")
    shape, dtype, source = w.get("shape"), w.get("dtype"), w.get("source", {})
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(where, f"shape must be a list of non-negative integers, got {_show(shape)}")
    if dtype not in DTYPES:
        raise _fail(where, f"dtype must be one of {', '.join(DTYPES)}, got {_show(dtype)}")
    if not isinstance(source, dict):
        raise _fail(where, "source must be an object")
    layout = w.get("layout", "rows")
    if not isinstance(layout, str) or not LAYOUT.fullmatch(layout):
        raise _fail(
            where,
            "layout must be rows, panels<lanes>x<group>, q8panels<lanes>, q4panels<lanes>, "
            "q5panels<lanes>, q6panels<lanes>, a8panels<lanes>, a4panels<lanes>, "
            f"spanels<lanes> or kpanels<lanes>, got {_show(layout)}",
        )
    dims = 3 if layout.startswith(("spanels", "kpanels")) else 2
    if layout != "rows" and len(shape) != dims:
        raise _fail(where, f"a {layout} layout needs a {dims}-D weight, got {_show(shape)}")
    if layout.startswith("q4panels") and shape[1] % 2:
        raise _fail(where, f"a {layout} layout needs an even number of columns, got {shape[1]}")
    if layout.startswith("q5panels") and shape[1] % 8:
        raise _fail(where, f"a {layout} layout needs columns in eights, got {shape[1]}")
    if layout.startswith("q6panels") and shape[1] % 4:
        raise _fail(where, f"a {layout} layout needs columns in fours, got {shape[1]}")
    if layout.startswith("a8panels") and shape[1] % 4:
        raise _fail(where, f"a {layout} layout needs columns in fours, got {shape[1]}")
    if layout.startswith("a4panels") and shape[1] % 8:
        raise _fail(where, f"a {layout} layout needs columns in eights, got {shape[1]}")
    return WeightSpec(tuple(shape), dtype, source, layout)


def load_graph(text: str | bytes) -> Graph:
    """A graph from its JSON text, checked (IRError names the first problem; text that is
    not JSON is a json.JSONDecodeError)."""
    return graph_from_json(json.loads(text))


def graph_from_json(data: Any) -> Graph:
    """Decode and check a graph; raises IRError naming the first offending field."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise IRError("expected an object with a 'nodes' list and a 'weights' object")
    weights = data.get("weights")
    if not isinstance(weights, dict):
        raise IRError("expected a 'weights' object")
    graph = Graph()
    graph.weights = {k: _decode_weight(k, w) for k, w in weights.items()}
    by_name: dict[str, Node] = {}
    for i, nd in enumerate(data["nodes"]):
        node = _decode_node(i, nd, by_name, graph)
        by_name[node.name] = node
    if "capture_plan" in data:
        graph.plan = _decode_plan(data["capture_plan"], by_name)
    if "context_length" in data:
        ctx = data["context_length"]
        if not _is_int(ctx) or not 1 < ctx <= MAX_CONTEXT:
            raise IRError(
                f"context_length must be an integer in [2, {MAX_CONTEXT}], got {_show(ctx)}"
            )
        graph.context_length = ctx
    return graph


def _decode_plan(plan: Any, by_name: dict[str, Node]) -> dict[str, Any]:
    """The capture plan's exact form: two parts of a known mode with sizes, the attention
    nodes it splits at, and (piecewise prefill) the node its eager tail starts at."""
    where = "capture_plan"
    if not isinstance(plan, dict) or set(plan) != {"decode", "prefill", "split_at"}:
        raise _fail(where, "expected an object of decode, prefill and split_at")
    parts = (
        ("decode", CAPTURE_MODES["decode"], "batch_sizes"),
        ("prefill", CAPTURE_MODES["prefill"], "tokens"),
    )
    for part, modes, sizes in parts:
        p = plan[part]
        keys = {"mode", sizes, "padding"} if part == "decode" else {"mode", sizes}
        if part == "prefill" and isinstance(p, dict) and p.get("mode") == "piecewise":
            keys.add("eager_from")
        # why the compiler did not lower the step, or record it in CUDA graphs
        for reason in ("native_refused", "graphs_refused"):
            if part == "decode" and isinstance(p, dict) and reason in p:
                keys.add(reason)
                why = p[reason]
                if not isinstance(why, str) or len(why) > 500:
                    raise _fail(f"{where}.decode.{reason}", f"expected a line, got {_show(why)}")
        if not isinstance(p, dict) or set(p) != keys or p["mode"] not in modes:
            raise _fail(f"{where}.{part}", f"expected {sorted(keys)} with a mode of {modes}")
        got = p[sizes]
        if not isinstance(got, list) or not all(_is_int(x) and x > 0 for x in got):
            raise _fail(f"{where}.{part}.{sizes}", f"expected positive integers, got {_show(got)}")
        if part == "decode" and not isinstance(p["padding"], bool):
            raise _fail(f"{where}.decode.padding", f"expected true or false, got {_show(p)}")
    split = plan["split_at"]
    cuts = (*ATTENTION_OPS, *HOST_SYNC_OPS)
    if not isinstance(split, list) or not all(
        isinstance(x, str) and x in by_name and by_name[x].op in cuts for x in split
    ):
        raise _fail(
            f"{where}.split_at", f"expected attention or moe node names, got {_show(split)}"
        )
    tail = plan["prefill"].get("eager_from")
    if tail is not None and not (isinstance(tail, str) and tail in by_name):
        raise _fail(f"{where}.prefill.eager_from", f"expected a node name, got {_show(tail)}")
    return plan
