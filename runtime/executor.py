"""The executor: the graph turned into one straight-line Python function, once, at load.

Each node becomes one line calling its kernel (chosen by `select_backends` and recorded in
the graph); weights and kernels are bound as globals of the generated function, and values
are deleted after their last use so long prefills do not hold every layer's activations.
No per-node interpretation happens while serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.compiler.ir import GRAPH_INPUTS, Graph, Node
from kiln.kernels import registry


def generate_source(graph: Graph) -> tuple[str, dict[str, Any]]:
    """Python source of `forward(ctx, input_ids, positions, logits_indices)` and its globals."""
    env: dict[str, Any] = {}
    names: dict[int, str] = {}
    kernel_names: dict[tuple[str, str], str] = {}
    last_use: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.args:
            last_use[id(a)] = i

    lines = [f"def forward(ctx, {', '.join(GRAPH_INPUTS)}):"]
    for i, n in enumerate(graph.nodes):
        if n.op == "input":
            names[id(n)] = n.attrs["name"]
            continue
        if n.op == "param":
            ident = f"w{len(env)}"
            env[ident] = n.attrs["name"]  # resolved to the tensor by Executor
            names[id(n)] = ident
            continue
        args = [names[id(a)] for a in n.args]
        if n.op == "output":
            lines.append(
                f"    return {args[0]}" if len(args) == 1 else f"    return ({', '.join(args)},)"
            )
            break
        var = f"v_{n.name}"
        names[id(n)] = var
        if n.op == "getitem":
            lines.append(f"    {var} = {args[0]}[{n.attrs['index']}]")
        else:
            lines.append(f"    {var} = {_call(n, args, env, kernel_names)}")
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


def _call(n: Node, args: list[str], env: dict[str, Any], kernel_names: dict) -> str:
    backend = n.meta.get("backend")
    if backend is None:
        raise ValueError(f"%{n.name}: no backend recorded; was select_backends run?")
    kernel = registry.get(n.op, backend)
    key = (n.op, backend)
    if key not in kernel_names:
        kernel_names[key] = f"k_{n.op}_{backend}"
        env[kernel_names[key]] = kernel.fn
    call_args = (["ctx"] if kernel.needs_ctx else []) + args
    call_args += [f"{k}={v!r}" for k, v in n.attrs.items()]
    return f"{kernel_names[key]}({', '.join(call_args)})"


class Executor:
    """Runs the compiled graph: `executor(ctx, input_ids, positions, logits_indices)`."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor]) -> None:
        self.source, env = generate_source(graph)
        namespace: dict[str, Any] = {}
        for ident, value in env.items():
            namespace[ident] = weights[value] if isinstance(value, str) else value
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
