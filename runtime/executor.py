"""The executor: the graph turned into one straight-line Python function, once, at load.

Each node becomes one line calling its kernel (chosen by `select_backends` and recorded in
the graph); values are deleted after their last use so long prefills do not hold every
layer's activations. No per-node interpretation happens while serving.

The graph comes from a file, so no string from it ever becomes source text: every name in
the generated code is a letter and a number the executor counts itself (`v12`, `k3`,
`w40`), kernels with their attributes are bound as values (`functools.partial`), weights
are bound as values, and the one literal, a getitem index, is formatted from a checked int.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kiln.compiler.ir import GRAPH_INPUTS, Graph, Node
from kiln.kernels import registry


def generate_source(
    graph: Graph, weights: dict[str, Any], lib: Any = None
) -> tuple[str, dict[str, Any]]:
    """Source of `forward(ctx, input_ids, positions, logits_indices)` and its globals."""
    env: dict[str, Any] = {}
    names: dict[int, str] = {}
    last_use: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.args:
            last_use[id(a)] = i

    params = [f"x{j}" for j in range(len(GRAPH_INPUTS))]
    lines = [f"def forward(ctx, {', '.join(params)}):"]
    for i, n in enumerate(graph.nodes):
        if n.op == "input":
            names[id(n)] = params[GRAPH_INPUTS.index(n.attrs["name"])]
            continue
        if n.op == "param":
            names[id(n)] = f"w{i}"
            env[f"w{i}"] = weights[n.attrs["name"]]
            continue
        args = [names[id(a)] for a in n.args]
        if n.op == "output":
            lines.append(
                f"    return {args[0]}" if len(args) == 1 else f"    return ({', '.join(args)},)"
            )
            break
        var = f"v{i}"
        names[id(n)] = var
        if n.op == "getitem":
            index = n.attrs["index"]
            if type(index) is not int:
                raise ValueError(f"%{n.name}: getitem index must be an int")
            lines.append(f"    {var} = {args[0]}[{index:d}]")
        else:
            env[f"k{i}"], needs_ctx = _bound_kernel(n, lib)
            call_args = (["ctx"] if needs_ctx else []) + args
            lines.append(f"    {var} = k{i}({', '.join(call_args)})")
        dead = [
            names[id(a)]
            for a in _unique(n.args)
            if last_use.get(id(a)) == i and a.op not in ("param", "input")
        ]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    return "\n".join(lines) + "\n", env


def _unique(nodes: list[Node]) -> list[Node]:
    seen: dict[int, Node] = {}
    for n in nodes:
        seen.setdefault(id(n), n)
    return list(seen.values())


def _bound_kernel(n: Node, lib: Any) -> tuple[Callable[..., Any], bool]:
    backend = n.meta.get("backend")
    if not isinstance(backend, str):
        raise ValueError(f"%{n.name}: no backend recorded; was select_backends run?")
    kernel = registry.get(n.op, backend)
    bound = dict(n.attrs)
    if kernel.native:
        if lib is None:
            raise ValueError(f"%{n.name}: the {backend} {n.op} kernel needs the native library")
        bound["lib"] = lib
    fn = functools.partial(kernel.fn, **bound) if bound else kernel.fn
    return fn, kernel.needs_ctx


class Executor:
    """Runs the compiled graph: `executor(ctx, input_ids, positions, logits_indices)`."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], lib: Any = None) -> None:
        """`lib`: the artefact's native library (runtime/native.py), for kiln_cpu nodes."""
        self.source, namespace = generate_source(graph, weights, lib)
        exec(compile(self.source, "<kiln graph>", "exec"), namespace)
        self._forward: Callable[..., Any] = namespace["forward"]

    @torch.inference_mode()
    def __call__(
        self,
        ctx: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        return self._forward(ctx, input_ids, positions, logits_indices)
