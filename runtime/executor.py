"""The executor: the graph turned into straight-line Python functions, once, at load.

Each node becomes one line calling its kernel (chosen by `select_backends` and recorded in
the graph); values are deleted after their last use so long prefills do not hold every
layer's activations. No per-node interpretation happens while serving. An op that attends
has two recorded kernels, one for decode steps (every sequence adds one token) and one for
the others (prefills, extends, mixed chunks): the executor makes one function per phase
and runs the one the step is.

The graph comes from a file, so no string from it ever becomes source text: every name in
the generated code is a letter and a number the executor counts itself (`v12`, `k3`,
`w40`), kernels with their attributes are bound as values (`functools.partial`), weights
are bound as values, and the one literal, a getitem index, is formatted from a checked int.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kiln.core.ir import GRAPH_INPUTS, Graph, Node
from kiln.core.lazy import resolve
from kiln.core.ops import ATTENTION_OPS, OPS
from kiln.kernels import catalog

# Kernels run from here on: the op definitions and backends get torch itself, not their
# stand-ins (kiln/core/lazy.py; torch.compile must see torch in a kernel's globals).
resolve()

Phase = Literal["decode", "prefill"]


@dataclass(frozen=True)
class Program:
    """Generated code and the function it defines."""

    source: str
    fn: Callable[..., Any]


def define(source: str, env: dict[str, Any], name: str) -> Callable[..., Any]:
    """The function `name` that `source` defines over `env`: the one place kiln runs code it
    generated (from numbered names and checked integers only; see the module docstring)."""
    exec(compile(source, f"<kiln {name}>", "exec"), env)
    fn: Callable[..., Any] = env[name]
    return fn


def last_uses(graph: Graph) -> dict[int, int]:
    """Each value's last reader, by node index (id(node) -> index)."""
    last: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.args:
            last[id(a)] = i
    return last


Wrap = Callable[[Node, Callable[..., Any], bool], tuple[Callable[..., Any], bool]]


def generate(
    graph: Graph,
    weights: dict[str, Any],
    lib: Any = None,
    phase: Phase = "decode",
    wrap: Wrap | None = None,
) -> Program:
    """`forward(ctx, input_ids, positions, logits_indices)` with `phase`'s kernels.
    `wrap(node, kernel, takes_ctx)`, if given, may replace a node's kernel (and whether it
    takes the step context): LoRA's linears (runtime/lora.py)."""
    env: dict[str, Any] = {}
    names: dict[int, str] = {}
    last_use = last_uses(graph)

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
            env[f"k{i}"], needs_ctx = bound_kernel(n, lib, phase)
            if wrap is not None:
                env[f"k{i}"], needs_ctx = wrap(n, env[f"k{i}"], needs_ctx)
            call_args = (["ctx"] if needs_ctx else []) + args
            lines.append(f"    {var} = k{i}({', '.join(call_args)})")
        dead = [
            names[id(a)]
            for a in _unique(n.args)
            if last_use.get(id(a)) == i and a.op not in ("param", "input")
        ]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    source = "\n".join(lines) + "\n"
    return Program(source, define(source, env, "forward"))


@dataclass(frozen=True)
class PieceInfo:
    """What a piece's maker needs to know about its calls: `piece(ctx?, a0.., b0..)`."""

    ctx: bool  # takes the step context first
    values: int  # a0..: values computed before it (the weights b0.. follow)
    keep: tuple[bool, ...]  # per output: read after the next made piece has run


def generate_piecewise(
    graph: Graph,
    weights: dict[str, Any],
    lib: Any,
    split: set[str],
    make_piece: Callable[[Callable[..., Any], tuple[Any, ...], PieceInfo], Callable[..., Any]],
    wrap_kernel: Callable[[Node, Callable[..., Any]], Callable[..., Any]] | None = None,
    make_split: Callable[[Callable[..., Any], PieceInfo], Callable[..., Any]] | None = None,
    eager_from: str | None = None,
    share: bool = True,
    phase: Phase = "decode",
) -> Program:
    """The same `forward`, cut at the nodes named in `split`: each run of nodes between two
    cuts becomes a function of its live inputs and its weights (`piece(a0, .., b0, ..)`,
    returning the values used after it), handed to `make_piece` with a key that is equal for
    pieces of identical code and kernels (every decoder layer's piece is the same function
    on other weights, so a compiler runs once per bucket, not once per layer; `share=False`
    makes one per call site, as a recording of fixed weights needs). Split nodes run
    between the pieces as one-node functions, through `make_split` when given. From the
    node `eager_from` on, the graph runs as plain functions (a tail whose shapes no bucket
    fixes). `wrap_kernel(node, kernel)`, if given, replaces each kernel inside a made piece
    (a compiler leaves opaque ones alone)."""
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    last_use = last_uses(graph)
    segments: list[list[Node]] = [[]]
    tails = [False]  # per segment: from `eager_from` on
    for n in graph.nodes:
        if n.op in ("input", "param"):
            continue
        if n.name == eager_from:
            segments.append([n])
            tails.append(True)
        elif n.op == "output" or (n.name in split and not tails[-1]):
            segments += [[n], []]
            tails += [tails[-1]] * 2
        else:
            segments[-1].append(n)
    kept = [(seg, tail) for seg, tail in zip(segments, tails, strict=True) if seg]
    segments = [seg for seg, _ in kept]
    made = [not tail and seg[0].name not in split and seg[0].op != "output" for seg, tail in kept]
    # A made piece's outputs that are read after the next made piece has run (a recording
    # may reuse their memory then).
    horizon = [len(graph.nodes)] * len(segments)
    following = len(graph.nodes)
    for j in range(len(segments) - 1, -1, -1):
        horizon[j] = following
        if made[j]:
            following = order[id(segments[j][-1])]

    env: dict[str, Any] = {}
    names: dict[int, str] = {}
    params = [f"x{j}" for j in range(len(GRAPH_INPUTS))]
    lines = [f"def forward(ctx, {', '.join(params)}):"]
    for i, n in enumerate(graph.nodes):
        if n.op == "input":
            names[id(n)] = params[GRAPH_INPUTS.index(n.attrs["name"])]
        elif n.op == "param":
            names[id(n)] = f"w{i}"
            env[f"w{i}"] = weights[n.attrs["name"]]
    built: dict[tuple[Any, ...], Callable[..., Any]] = {}
    for j, seg in enumerate(segments):
        if seg[0].op == "output":
            args = [names[id(a)] for a in seg[0].args]
            lines.append(
                f"    return {args[0]}" if len(args) == 1 else f"    return ({', '.join(args)},)"
            )
            break
        source, piece_env, ins, outs, takes_ctx = _piece_source(
            seg, order, last_use, lib, wrap_kernel if made[j] else None, phase
        )
        info = PieceInfo(
            takes_ctx,
            sum(a.op != "param" for a in ins),
            tuple(last_use[id(o)] > horizon[j] for o in outs),
        )
        key = (source, *_kernel_keys(seg)) + (() if share else (j,))
        if key not in built:
            fn = define(source, piece_env, "piece")
            if made[j]:
                fn = make_piece(fn, key, info)
            elif make_split is not None and seg[0].name in split:
                fn = make_split(fn, info)
            built[key] = fn
        pname = f"p{len(env)}"
        env[pname] = built[key]
        for o in outs:
            names[id(o)] = f"v{order[id(o)]}"
        call = f"{pname}({', '.join(['ctx'] * info.ctx + [names[id(a)] for a in ins])})"
        targets = ", ".join(names[id(o)] for o in outs)
        lines.append(f"    {targets}{',' if len(outs) == 1 else ''} = {call}")
        end = order[id(seg[-1])]
        dead = [
            names[id(a)]
            for a in ins
            if a.op not in ("param", "input")
            and order[id(a)] < order[id(seg[0])]
            and last_use.get(id(a), -1) <= end
        ]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    source = "\n".join(lines) + "\n"
    return Program(source, define(source, env, "forward"))


def _takes_ctx(seg: list[Node]) -> bool:
    return any(OPS[n.op].needs_ctx for n in seg)


def _kernel_keys(seg: list[Node]) -> list[Any]:
    return [(n.op, n.meta.get("backend"), repr(sorted(n.attrs.items()))) for n in seg]


def _piece_source(
    seg: list[Node],
    order: dict[int, int],
    last_use: dict[int, int],
    lib: Any,
    wrap_kernel: Callable[[Node, Callable[..., Any]], Callable[..., Any]] | None,
    phase: Phase,
) -> tuple[str, dict[str, Any], list[Node], list[Node], bool]:
    """`piece(ctx?, a0.., b0..)` over `seg`: its inputs (values from before it, then its
    weights), its outputs (values used after it) and whether it takes the context."""
    inside = {id(n) for n in seg}
    end = max(order[id(n)] for n in seg)
    values: list[Node] = []
    weights: list[Node] = []
    for n in seg:
        for a in n.args:
            if id(a) in inside:
                continue
            group = weights if a.op == "param" else values
            if all(a is not b for b in group):
                group.append(a)
    outs = [n for n in seg if last_use.get(id(n), -1) > end]
    env: dict[str, Any] = {}
    local: dict[int, str] = {}
    for j, a in enumerate(values):
        local[id(a)] = f"a{j}"
    for j, a in enumerate(weights):
        local[id(a)] = f"b{j}"
    needs_ctx = _takes_ctx(seg)
    head = (["ctx"] if needs_ctx else []) + [local[id(a)] for a in values + weights]
    lines = [f"def piece({', '.join(head)}):"]
    for j, n in enumerate(seg):
        var = f"t{j}"
        local[id(n)] = var
        args = [local[id(a)] for a in n.args]
        if n.op == "getitem":
            index = n.attrs["index"]
            if type(index) is not int:
                raise ValueError(f"%{n.name}: getitem index must be an int")
            lines.append(f"    {var} = {args[0]}[{index:d}]")
            continue
        kernel, ctx_arg = bound_kernel(n, lib, phase)
        env[f"k{j}"] = kernel if wrap_kernel is None else wrap_kernel(n, kernel)
        lines.append(f"    {var} = k{j}({', '.join((['ctx'] if ctx_arg else []) + args)})")
    lines.append(f"    return ({''.join(local[id(o)] + ', ' for o in outs)})")
    return "\n".join(lines) + "\n", env, values + weights, outs, needs_ctx


def _unique(nodes: list[Node]) -> list[Node]:
    seen: dict[int, Node] = {}
    for n in nodes:
        seen.setdefault(id(n), n)
    return list(seen.values())


def backend_of(n: Node, phase: Phase) -> str:
    """The backend the graph records for `n` in `phase` (ops that attend record one per
    phase; the others one for both)."""
    backend = n.meta.get(
        "prefill_backend" if phase == "prefill" and n.op in ATTENTION_OPS else "backend"
    )
    if not isinstance(backend, str):
        raise ValueError(f"%{n.name}: no {phase} backend recorded; was select_backends run?")
    return backend


def bound_kernel(n: Node, lib: Any, phase: Phase) -> tuple[Callable[..., Any], bool]:
    """`n`'s kernel for `phase` with its attributes (and the native library) bound, and
    whether it takes the step context first."""
    backend = backend_of(n, phase)
    kernel = catalog.get(n.op, backend)
    bound: dict[str, Any] = {"a": kernel.op.bind(n.attrs)} if kernel.op.fields else {}
    if kernel.native:
        if lib is None:
            raise ValueError(f"%{n.name}: the {backend} {n.op} kernel needs the native library")
        bound["lib"] = lib
    fn = functools.partial(kernel.fn, **bound) if bound else kernel.fn
    return fn, kernel.needs_ctx


class Executor:
    """Runs the compiled graph: `executor(ctx, input_ids, positions, logits_indices)`, with
    the decode kernels on a decode step (`ctx.decode`) and the prefill kernels otherwise."""

    def __init__(
        self,
        graph: Graph,
        weights: dict[str, torch.Tensor],
        lib: Any = None,
        wrap: Wrap | None = None,
    ) -> None:
        """`lib`: the artefact's native library (runtime/native.py), for kiln_cpu nodes;
        `wrap`: see `generate`."""
        self.decode = generate(graph, weights, lib, "decode", wrap)
        phased = any(
            backend_of(n, "prefill") != backend_of(n, "decode")
            for n in graph.nodes
            if n.op in ATTENTION_OPS
        )
        self.prefill = generate(graph, weights, lib, "prefill", wrap) if phased else self.decode

    @torch.inference_mode()
    def __call__(
        self,
        ctx: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        program = self.decode if ctx.decode else self.prefill
        return program.fn(ctx, input_ids, positions, logits_indices)
