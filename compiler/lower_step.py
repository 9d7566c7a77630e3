"""Lowering a step to native code: the graph -> one C function per artefact.

A decode step run by the Python executor is ~200-300 kernel calls, each a ctypes call with
its tensors made and checked in Python: 2 ms of a 7.9 ms step for SmolLM2-135M on a 2-core
Zen 4 (benchmarks/RESULTS.md). Lowered, the same calls are one C function (`kiln_step_run`)
that the runtime calls once a step: every node is one line calling its kiln_cpu kernel
through the kernel table (kernels/csrc/kiln_step.h), with each weight's index, each shape
and attribute and each activation's place in one arena written in as literals; what varies
per step (row count, ids, positions, the page tables, the KV pool) comes in the step's
arguments. Activations live in an arena of `width` floats per row (offsets reused once a
value is dead, first fit), so the step allocates nothing.

One function runs every kind of step: a row is a new token that attends to its sequence's
keys up to its own (each row's KV length and page table come in the arguments), so a
decode step is a row a sequence, and a prefill, extend, mixed or verify step a row a new
token; every layer writes all rows' K/V before any row attends, which makes the rows of one
prompt exactly causal. The attention kernel scores a sequence's consecutive rows together
(kernels/csrc/cpu_kernels.c, attend_runs), so a prefill's attention is blocked like a
prefill kernel's, not row by row.

The lowering takes the graph as the passes left it and refuses, with the reason, any node
it has no native form for (an op or backend not below, an fp8 KV pool's attention, a
tensor-parallel collective): the artefact then runs its steps in the Python executor,
which stays the reference.

The graph comes from our own trace of a checkpoint's config, and nothing but integers and
floats from it reaches the C text: identifiers are fixed here, numbers are checked
(`_int`, `_float`) before they are formatted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.core.check import infer_types
from kiln.core.ir import Graph, IRError, Node
from kiln.core.ops import ATTENTION_OPS
from kiln.core.quant import FORMATS
from kiln.core.recipes import lora_modules
from kiln.kernels import native

HEADER = native.SOURCE.parent / "kiln_step.h"

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4}
_PROLOGUES = {"none": 0, "silu_and_mul": 1}
_UNARY = {"scale": "STEP_SCALE", "silu": "STEP_SILU", "relu2": "STEP_RELU2"}


class Refused(ValueError):
    """The graph has a node the native step cannot run; the message says which and why."""


@dataclass(frozen=True)
class Buf:
    """A float32 activation: `expr` is its first row's address in C, rows `stride` floats
    apart, `width` floats each; `rows` the C name of its row count; `alloc` the arena
    allocation it lives in (None: not the arena's)."""

    expr: str
    width: int
    stride: int
    rows: str
    alloc: int | None = None

    def column(self, start: int, width: int) -> Buf:
        return Buf(f"({self.expr} + {start})", width, self.stride, self.rows, self.alloc)

    @property
    def contiguous(self) -> bool:
        return self.stride == self.width


@dataclass
class LoweredStep:
    """The generated C and what the runtime binds it to."""

    source: str
    weights: list[str]  # W[i] of the C is this weight
    weight_bytes: list[int]
    arena_width: int  # floats per row
    logits_width: int
    calls: int  # kernel calls a step makes
    nodes: list[str] = field(default_factory=list)  # the lowered nodes' one-line forms


def _int(v: Any, what: str) -> int:
    if type(v) is not int or not -(2**62) < v < 2**62:
        raise Refused(f"{what}: {v!r} is not an integer")
    return v


def _float(v: Any, what: str) -> str:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise Refused(f"{what}: {v!r} is not a finite number")
    return f"{float(v)!r}f"


class _Arena:
    """First-fit offsets (floats per row) over a line; `width` is the high-water mark."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}  # alloc -> (offset, width)
        self.width = 0
        self._next = 0

    def take(self, width: int) -> tuple[int, int]:
        at = 0
        for off, w in sorted(self.live.values()):
            if off - at >= width:
                break
            at = max(at, off + w)
        self._next += 1
        self.live[self._next] = (at, width)
        self.width = max(self.width, at + width)
        return self._next, at

    def free(self, alloc: int) -> None:
        self.live.pop(alloc, None)


def lower_step(graph: Graph, kv_dtype: str | None = None) -> LoweredStep:
    """The step of `graph` as C, over a float32 KV pool or (`kv_dtype`) an fp8 one; Refused
    if a node has no native form (or the graph does not type-check)."""
    kv_format = native.KV_FORMATS.get(kv_dtype or "float32")
    if kv_format is None:
        raise Refused(f"a {kv_dtype} KV pool")
    try:
        return _Lowering(graph, kv_format).run()
    except IRError as e:
        raise Refused(str(e)) from None


class _Lowering:
    def __init__(self, graph: Graph, kv_format: int = 0) -> None:
        self.graph = graph
        self.kv_format = kv_format  # 0: float32 pool; 1, 2: fp8 e4m3fn, e5m2 bytes
        self.types = infer_types(graph)
        self.values: dict[int, Any] = {}
        self.weights: list[str] = []
        self.weight_bytes: list[int] = []
        self.weight_index: dict[str, int] = {}
        self.arena = _Arena()
        self.lines: list[str] = []
        self.calls = 0
        self.call_nodes: list[int] = []  # each call's node, by graph index
        self.nodes: list[str] = []
        self.refs: dict[int, int] = {}  # alloc -> live values reading it
        self.out_node: Node | None = None
        self.pool_floats = 0  # floats per KV slot the step's layers reach
        self.rope_widths: list[int] = []  # each rope_cos_sin node's table width
        # LoRA hooks: each linear an adapter may touch, by its weight's index (W[i])
        self.lora_hooks: list[int] = []
        # The second output's width and rows (1: every row, 0: the logits rows), and the
        # width of the hidden states an EAGLE head's step reads (its step_hidden node)
        self.hidden_width, self.hidden_rows, self.hidden_in = 0, 0, 0

    # -- values ---------------------------------------------------------------------------
    def width_of(self, n: Node) -> int:
        t = self.types[n.name]
        if isinstance(t, tuple) or t.dtype != "float32" or t.features is None:
            raise Refused(f"%{n.name} ({n.op}): a {t} value, the native step runs float32 rows")
        return _int(t.features, f"%{n.name} features")

    def new(self, n: Node, width: int, rows: str) -> Buf:
        if n is self.out_node:
            return Buf("s->logits", width, width, rows)
        alloc, off = self.arena.take(width)
        return Buf(f"A({off})", width, width, rows, alloc)

    def weight(self, n: Node) -> str:
        if n.op != "param":
            raise Refused(f"%{n.name}: a weight operand that is not a weight")
        name = n.attrs["name"]
        if name not in self.weight_index:
            spec = self.graph.weights[name]
            if spec.dtype not in _ITEMSIZE:
                raise Refused(f"weight {name}: dtype {spec.dtype}")
            size = _ITEMSIZE[spec.dtype]
            for d in spec.stored_shape:
                size *= _int(d, f"weight {name} shape")
            self.weight_index[name] = len(self.weights)
            self.weights.append(name)
            self.weight_bytes.append(size)
        return f"W[{self.weight_index[name]}]"

    def buf(self, n: Node) -> Buf:
        v = self.values.get(id(n))
        if not isinstance(v, Buf):
            raise Refused(f"%{n.name} ({n.op}): not a float32 activation where one is read")
        return v

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> LoweredStep:
        g = self.graph
        last: dict[int, int] = {}
        for i, n in enumerate(g.nodes):
            for a in n.args:
                last[id(a)] = i
        out = g.output
        if len(out.args) > 2:
            raise Refused(f"a step of {len(out.args)} outputs")
        self.out_node = out.args[0]
        for i, n in enumerate(g.nodes):
            if n.op == "output":
                if len(out.args) == 2:  # hidden states (--enable-return-hidden-states, EAGLE)
                    self._second_output(i, out.args[1])
                break
            self.lower(i, n)
            self.nodes.append(n.format())
            # a value's arena space is free once nothing that reads it is live
            for a in {id(a): a for a in n.args}.values():
                if last.get(id(a)) == i:
                    self.drop(self.values.get(id(a)))
            if id(n) not in last:
                self.drop(self.values.get(id(n)))
        logits = self.values.get(id(self.out_node))
        if not isinstance(logits, Buf) or logits.expr != "s->logits" or logits.rows != "R":
            raise Refused("the logits are not the output of a node over the logits rows")
        self.logits_width = logits.width
        return LoweredStep(
            self.source(),
            self.weights,
            self.weight_bytes,
            max(self.arena.width, 1),
            self.logits_width,
            self.calls,
            self.nodes,
        )

    def _second_output(self, i: int, n: Node) -> None:
        """The hidden states a step returns besides its logits, copied to s->hidden: every
        row's (an EAGLE model's) or the logits rows' (--enable-return-hidden-states, an
        EAGLE head's own)."""
        h = self.buf(n)
        if h.rows not in ("M", "R"):
            raise Refused(f"%{n.name}: hidden states over {h.rows} rows")
        self.hidden_width, self.hidden_rows = h.width, int(h.rows == "M")
        self.emit(
            i, f"step_copy({h.expr}, {h.stride}, {h.width}, {h.rows}, s->hidden, {h.width})", False
        )

    def keep(self, n: Node, value: Any) -> None:
        self.values[id(n)] = value
        for b in value if isinstance(value, tuple) else (value,):
            if isinstance(b, Buf) and b.alloc is not None:
                self.refs[b.alloc] = self.refs.get(b.alloc, 0) + 1

    def drop(self, value: Any) -> None:
        for b in value if isinstance(value, tuple) else (value,):
            if isinstance(b, Buf) and b.alloc is not None:
                self.refs[b.alloc] -= 1
                if self.refs[b.alloc] == 0:
                    self.arena.free(b.alloc)

    def produce(
        self,
        i: int,
        n: Node,
        width: int,
        rows: str,
        call: Callable[[Buf], str],
        checked: bool = True,
    ) -> None:
        """`n`'s one output: `width` floats a row over `rows` rows, written by the C call
        `call(out)` (its return code checked unless the kernel returns none)."""
        out = self.new(n, width, rows)
        self.emit(i, call(out), checked)
        self.keep(n, out)

    def emit(self, i: int, call: str, checked: bool = True, per_row: str | None = None) -> None:
        """One kernel call (`per_row`: once for each r_ below that row count)."""
        loop = f"for (int64_t r_ = 0; r_ < {per_row}; r_++) " if per_row else ""
        self.lines.append(f"    {loop}STEP_CALL({i}, {call});" if checked else f"    {loop}{call};")
        self.lines.append(f"    STEP_TICK({self.calls});")
        self.call_nodes.append(i)
        self.calls += 1

    def lower(self, i: int, n: Node) -> None:
        op = n.op
        backend = n.meta.get("backend")
        if op in ATTENTION_OPS:
            backend = n.meta.get("backend")  # the decode kernel
        if op == "input":
            name = n.attrs["name"]
            where = {"input_ids": "s->ids", "positions": "s->positions"}
            where["logits_indices"] = "s->logits_rows"
            if name not in where:
                raise Refused(f"input {name}")
            self.keep(n, where[name])
            return
        if op == "param":
            self.keep(n, n)
            return
        if op == "getitem":
            parts = self.values.get(id(n.args[0]))
            if not isinstance(parts, tuple):
                raise Refused(f"%{n.name}: getitem of a single value")
            self.keep(n, parts[_int(n.attrs["index"], "getitem index")])
            return
        handler = getattr(self, f"_{op}", None)
        wanted = "torch_native" if op in _TORCH_NATIVE else "kiln_cpu"
        if handler is None or backend != wanted:
            raise Refused(f"%{n.name}: {op} on {backend} has no native form")
        handler(i, n, n.attrs)

    # -- ops (the name is the op's) -------------------------------------------------------
    def _rope_cos_sin(self, i: int, n: Node, a: dict[str, Any]) -> None:
        pos, inv = n.args
        if self.values.get(id(pos)) != "s->positions":
            raise Refused(f"%{n.name}: rotary tables of other than the step's positions")
        spec = self.graph.weights[inv.attrs["name"]]
        if spec.dtype != "float32" or len(spec.shape) != 1:
            raise Refused(f"%{n.name}: an inv_freq table of {spec.dtype} {spec.shape}")
        d = 2 * _int(spec.shape[0], "inv_freq")
        cos, sin = self.new(n, d, "M"), self.new(n, d, "M")
        self.emit(
            i,
            f"step_rope_rows(s->rope[{len(self.rope_widths)}], s->rope_rows, {d}, "
            f"s->positions, M, {cos.expr}, {sin.expr})",
        )
        self.rope_widths.append(d)
        self.keep(n, (cos, sin))

    def _embedding(self, i: int, n: Node, a: dict[str, Any]) -> None:
        ids, table = n.args
        spec = self.graph.weights[table.attrs["name"]]
        if spec.dtype != "float32" or spec.layout != "rows" or len(spec.shape) != 2:
            raise Refused(f"%{n.name}: an embedding table of {spec.dtype} {spec.layout}")
        vocab, h = (_int(d, "embedding shape") for d in spec.shape)
        table_at = self.weight(table)
        self.produce(
            i,
            n,
            h,
            "M",
            lambda out: (
                f"step_gather((const float *){table_at}, {h}, {h}, {vocab}, "
                f"{self.ids(ids)}, M, {out.expr})"
            ),
        )

    def ids(self, n: Node) -> str:
        if self.values.get(id(n)) != "s->ids":
            raise Refused(f"%{n.name}: token ids other than the step's")
        return "s->ids"

    def _packed_embedding(self, i: int, n: Node, a: dict[str, Any]) -> None:
        ids, table = n.args
        shape = self.graph.weights[table.attrs["name"]].stored_shape
        h = _int(shape[1], "table shape")
        vocab = _int(shape[0], "table shape") * _int(shape[2], "table shape")
        table_at = self.weight(table)
        self.produce(
            i,
            n,
            h,
            "M",
            lambda out: (
                f"s->k->embedding_packed({self.ids(ids)}, M, (const float *){table_at}, "
                f"{vocab}, {h}, {out.expr})"
            ),
        )

    def _quant_embedding(self, i: int, n: Node, a: dict[str, Any]) -> None:
        ids, codes, scales = n.args
        form, group = FORMATS[a["format"]], _int(a["group"], "group")
        sshape = self.graph.weights[scales.attrs["name"]].stored_shape
        h = _int(sshape[1], "scales shape") * group
        if form.superblock:
            h = sshape[1] // form.record_bytes * form.superblock * group
        head = f"{self.ids(ids)}, M, {self.weight(codes)}, {self.weight(scales)}"
        tail = f"{_int(form.qfmt, 'qfmt')}, {group}, {_int(a['num_embeddings'], 'vocab')}, {h}"
        self.produce(i, n, h, "M", lambda out: f"s->k->qembedding({head}, {tail}, {out.expr})")

    def _rmsnorm(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        width = x.width
        group = self._group(n, a, width)
        groups = width // group
        out = self.new(n, width, x.rows)
        self.emit(
            i,
            f"s->k->rmsnorm({x.expr}, {x.stride}, {groups}, (const float *)"
            f"{self.weight(n.args[1])}, {out.expr}, {x.rows} * {groups}, {group}, "
            f"{_float(a['eps'], 'eps')}, T)",
            checked=False,
        )
        self.keep(n, out)

    def _layernorm(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        group = self._group(n, a, x.width)
        groups = x.width // group
        # one weight every group shares (step 0), or one for every feature (step: a group)
        size = self.graph.weights[n.args[1].attrs["name"]].stored_shape[0]
        step = 0 if size == group else group
        out = self.new(n, x.width, x.rows)
        self.emit(
            i,
            f"s->k->layernorm({x.expr}, {x.stride}, {groups}, "
            f"(const float *){self.weight(n.args[1])}, {self._bias(n, 2)}, {step}, "
            f"{out.expr}, {x.rows} * {groups}, {group}, {_float(a['eps'], 'eps')}, T)",
            checked=False,
        )
        self.keep(n, out)

    @staticmethod
    def _group(n: Node, a: dict[str, Any], width: int) -> int:
        """A norm's features a group: its `group`, or the whole row."""
        group = _int(a.get("group", 0), "group") or width
        if width % group:
            raise Refused(f"%{n.name}: {width} features in groups of {group}")
        return group

    def _add_rmsnorm(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x, res = self.buf(n.args[0]), self.buf(n.args[1])
        if not (x.contiguous and res.contiguous and x.width == res.width):
            raise Refused(f"%{n.name}: add_rmsnorm of strided or unequal rows")
        out, total = self.new(n, x.width, x.rows), self.new(n, x.width, x.rows)
        self.emit(
            i,
            f"s->k->add_rmsnorm({x.expr}, {res.expr}, (const float *){self.weight(n.args[2])}, "
            f"{out.expr}, {total.expr}, {x.rows}, {x.width}, {_float(a['eps'], 'eps')}, T)",
            checked=False,
        )
        self.keep(n, (out, total))

    def _silu_and_mul(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        if not x.contiguous or x.width % 2:
            raise Refused(f"%{n.name}: silu_and_mul of strided rows")
        self._rowwise(
            i,
            n,
            lambda x, o: f"s->k->silu_and_mul({x.expr}, {o.expr}, {x.rows}, {o.width}, T)",
            x.width // 2,
        )

    def _bias(self, n: Node, index: int) -> str:
        return "NULL" if len(n.args) <= index else f"(const float *){self.weight(n.args[index])}"

    def _packed_linear(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        lo, hi = (_int(r, "narrow_rows") for r in a["narrow_rows"])
        k = x.width // (2 if a["prologue"] == "silu_and_mul" else 1)
        width = _int(a["out_features"], "out_features")
        head = f"{x.expr}, {x.stride}, {x.rows}, {k}, (const float *){self.weight(n.args[1])}"
        wide = f"!({lo} <= {x.rows} && {x.rows} <= {hi})"
        self.produce(
            i,
            n,
            width,
            x.rows,
            lambda out: (
                f"s->k->linear({head}, {width}, {self._bias(n, 2)}, {out.expr}, "
                f"{wide}, {_PROLOGUES[a['prologue']]}, T)"
            ),
        )
        self._lora_hook(n, x, k, a["prologue"])

    def _quant_linear(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        form, group = FORMATS[a["format"]], _int(a["group"], "group")
        k = x.width // (2 if a["prologue"] == "silu_and_mul" else 1)
        width = _int(a["out_features"], "out_features")
        codes, scales = self.weight(n.args[1]), self.weight(n.args[2])
        head = f"{x.expr}, {x.stride}, {x.rows}, {k}, {codes}, {scales}"
        bias, prologue = self._bias(n, 3), _PROLOGUES[a["prologue"]]
        if form.kernel == "a8":
            fn, kind_group = "a8_linear", ""
        else:
            fn, kind = ("ga8_linear", form.ga8) if form.kernel == "ga8" else ("qlinear", form.qfmt)
            kind_group = f"{_int(kind, 'kind')}, {group}, "
        if a.get("deterministic") and fn == "qlinear":
            # --enable-deterministic-inference: each row its own call, so it rounds as
            # it would alone (passes/deterministic.py)
            out = self.new(n, width, x.rows)
            row = f"{x.expr} + r_ * {x.stride}, {x.stride}, 1, {k}, {codes}, {scales}"
            call = (
                f"s->k->{fn}({row}, {kind_group}{width}, {bias}, {out.expr} + r_ * "
                f"{out.stride}, {prologue}, T)"
            )
            self.emit(i, call, per_row=x.rows)
            self.keep(n, out)
            self._lora_hook(n, x, k, a["prologue"])
            return
        self.produce(
            i,
            n,
            width,
            x.rows,
            lambda out: (
                f"s->k->{fn}({head}, {kind_group}{width}, {bias}, {out.expr}, {prologue}, T)"
            ),
        )
        self._lora_hook(n, x, k, a["prologue"])

    def _lora_hook(self, n: Node, x: Buf, k: int, prologue: str) -> None:
        """After a linear whose weight is built from LoRA projections (q, k, v, o, gate,
        up, down): the step's adapters add their deltas to its rows (kiln_step.h
        step_lora), when the runtime passes any. A branch when it passes none."""
        param = n.args[1]
        if not lora_modules(self.graph.weights[param.attrs["name"]].source):
            return
        out = self.buf(n)
        hook = len(self.lora_hooks)
        self.lora_hooks.append(self.weight_index[param.attrs["name"]])
        gated = int(prologue == "silu_and_mul")
        self.lines.append(
            f"    if (s->lora) step_lora(s, {hook}, {x.expr}, {x.stride}, {k}, {gated}, "
            f"{out.expr}, {out.stride}, {out.width}, {x.rows}, T);"
        )

    def _rope(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x, (cos, sin) = self.buf(n.args[0]), self.values[id(n.args[1])]
        d = _int(a["head_dim"], "head_dim")
        if cos.width != d or x.width % d:
            raise Refused(f"%{n.name}: rotary tables of {cos.width}, head_dim {d}")
        out = self.new(n, x.width, x.rows)
        self.rope_call(i, x, cos.expr, sin.expr, out, x.width // d, d)
        self.keep(n, out)

    def rope_call(self, i: int, x: Buf, cos: str, sin: str, out: Buf, heads: int, d: int) -> None:
        self.emit(
            i,
            f"s->k->rope({x.expr}, {x.stride}, {cos}, {sin}, {out.expr}, {x.rows}, {heads}, "
            f"{d}, T)",
            checked=False,
        )

    def _rope_qkv(self, i: int, n: Node, a: dict[str, Any]) -> None:
        qkv, (cos, sin) = self.buf(n.args[0]), self.values[id(n.args[1])]
        d = _int(a["head_dim"], "head_dim")
        nq, nk, nv = (_int(s, "sizes") for s in a["sizes"])
        if cos.width != d or (nq + nk) % d:
            raise Refused(f"%{n.name}: rotary tables of {cos.width}, head_dim {d}")
        qk = self.new(n, nq + nk, qkv.rows)
        self.rope_call(i, qkv, cos.expr, sin.expr, qk, (nq + nk) // d, d)
        self.keep(n, (qk.column(0, nq), qk.column(nq, nk), qkv.column(nq + nk, nv)))

    def _attention_attrs(self, n: Node, a: dict[str, Any]) -> tuple[int, ...]:
        d = _int(a["head_dim"], "head_dim")
        layer, kv = _int(a["layer"], "layer"), _int(a["num_kv_heads"], "num_kv_heads")
        self.pool_floats = max(self.pool_floats, (layer + 1) * kv * d)
        if d % 8:
            raise Refused(f"%{n.name}: head_dim {d} is not a multiple of 8")
        if not self.kv_format and _float(a["kv_scale"], "kv_scale") != "1.0f":
            raise Refused(f"%{n.name}: a scaled float32 KV pool")
        heads = _int(a["num_heads"], "num_heads")
        return layer, heads, kv, d, _int(a["sliding_window"] or 0, "sliding_window")

    def pool(self, layer: int, kv: int, d: int) -> tuple[str, str]:
        at = f"(int64_t){layer} * {kv * d} * s->pool_slots"
        if self.kv_format:  # one byte an element
            return f"((uint8_t *)s->k_pool + {at})", f"((uint8_t *)s->v_pool + {at})"
        return f"(s->k_pool + {at})", f"(s->v_pool + {at})"

    def _attention(self, i: int, n: Node, a: dict[str, Any]) -> None:
        q, k, v = (self.buf(x) for x in n.args[:3])
        self._attend(i, n, a, q, k, v)

    def _attend(self, i: int, n: Node, a: dict[str, Any], q: Buf, k: Buf, v: Buf) -> None:
        """K and V written to the pool, then q's rows attending to it (the executor's
        attention on this backend, kernels/cpu.py)."""
        layer, heads, kv, d, window = self._attention_attrs(n, a)
        sinks = "NULL"
        if len(n.args) > 3:
            spec = self.graph.weights[n.args[3].attrs["name"]]
            if spec.dtype != "float32" or tuple(spec.shape) != (heads,):
                raise Refused(f"%{n.name}: sinks of {spec.dtype} {spec.shape}")
            sinks = f"(const float *){self.weight(n.args[3])}"
        kp, vp = self.pool(layer, kv, d)
        where = f"{k.expr}, {k.stride}, {v.expr}, {v.stride}, s->slots, M, {kp}, {vp}"
        scale = "1.0f"
        if self.kv_format:
            scale = _float(a["kv_scale"], "kv_scale")
            write = f"kv_write_fp8({where}, s->pool_slots, {kv}, {d}, {self.kv_format}, {scale})"
        else:
            write = f"kv_write({where}, s->pool_slots, {kv}, {d})"
        self.emit(i, f"s->k->{write}", checked=False)
        out = self.new(n, heads * d, q.rows)
        self.emit(
            i,
            f"s->k->decode_attention({q.expr}, {q.stride}, {kp}, {vp}, s->pool_slots, "
            f"s->kv_index, s->kv_pages, s->kv_lens, s->kv_rows, {out.expr}, M, {heads}, {kv}, {d}, "
            f"s->page_size, {window}, {_float(a['scale'], 'scale')}, {self.kv_format}, {scale}, "
            f"{_float(a['softcap'], 'softcap')}, {sinks}, T, {int(a.get('deterministic', 0))})",
        )
        self.keep(n, out)

    def _rope_attention(self, i: int, n: Node, a: dict[str, Any]) -> None:
        qkv, (cos, sin) = self.buf(n.args[0]), self.values[id(n.args[1])]
        layer, heads, kv, d, window = self._attention_attrs(n, a)
        if cos.width != d:
            raise Refused(f"%{n.name}: rotary tables of {cos.width}, head_dim {d}")
        if self.kv_format:
            # The fused kernel writes float32 K/V: rotary over q and k, then the fp8 write
            # and attention, as the executor runs this node on an fp8 pool.
            nq, nk = heads * d, kv * d
            qk = self.new(n, nq + nk, qkv.rows)
            self.rope_call(i, qkv, cos.expr, sin.expr, qk, heads + kv, d)
            self._attend(i, n, a, qk.column(0, nq), qk.column(nq, nk), qkv.column(nq + nk, nk))
            assert qk.alloc is not None
            self.arena.free(qk.alloc)
            return
        kp, vp = self.pool(layer, kv, d)
        out = self.new(n, heads * d, qkv.rows)
        self.emit(
            i,
            f"s->k->rope_decode_attention({qkv.expr}, {qkv.stride}, {cos.expr}, {sin.expr}, "
            f"s->slots, {kp}, {vp}, s->pool_slots, s->kv_index, s->kv_pages, s->kv_lens, "
            f"s->kv_rows, {out.expr}, M, {heads}, {kv}, {d}, s->page_size, {window}, "
            f"{_float(a['scale'], 'scale')}, {_float(a['softcap'], 'softcap')}, NULL, T, "
            f"{int(a.get('deterministic', 0))})",
        )
        self.keep(n, out)

    def _binary(self, i: int, n: Node, what: str) -> None:
        x, y = self.buf(n.args[0]), self.buf(n.args[1])
        if x.width != y.width or x.rows != y.rows:
            raise Refused(f"%{n.name}: {n.op} of unequal shapes")
        out = self.new(n, x.width, x.rows)
        self.emit(
            i,
            f"step_binary({what}, {x.expr}, {x.stride}, {y.expr}, {y.stride}, {out.expr}, "
            f"{x.rows}, {x.width})",
            checked=False,
        )
        self.keep(n, out)

    def _add(self, i: int, n: Node, a: dict[str, Any]) -> None:
        self._binary(i, n, "STEP_ADD")

    def _mul(self, i: int, n: Node, a: dict[str, Any]) -> None:
        self._binary(i, n, "STEP_MUL")

    def _rowwise(self, i: int, n: Node, call: Callable[[Buf, Buf], str], width: int = 0) -> None:
        """A node that maps its one input's rows to new ones (`width` floats; 0: the
        input's): `call(x, out)` is the C call."""
        x = self.buf(n.args[0])
        self.produce(i, n, width or x.width, x.rows, lambda out: call(x, out), checked=False)

    def _unary(self, i: int, n: Node, c: str) -> None:
        what = _UNARY[n.op]
        self._rowwise(
            i,
            n,
            lambda x, o: (
                f"step_unary({what}, {x.expr}, {x.stride}, {c}, {o.expr}, {x.rows}, {x.width})"
            ),
        )

    def _scale(self, i: int, n: Node, a: dict[str, Any]) -> None:
        self._unary(i, n, _float(a["factor"], "factor"))

    def _softcap(self, i: int, n: Node, a: dict[str, Any]) -> None:
        cap = _float(a["cap"], "cap")
        self._rowwise(
            i,
            n,
            lambda x, o: (
                f"s->k->softcap({x.expr}, {x.stride}, {cap}, {o.expr}, {x.rows}, {x.width}, T)"
            ),
        )

    def _gelu_tanh(self, i: int, n: Node, a: dict[str, Any]) -> None:
        self._rowwise(
            i,
            n,
            lambda x, o: f"s->k->gelu_tanh({x.expr}, {x.stride}, {o.expr}, {x.rows}, {x.width}, T)",
        )

    def _silu(self, i: int, n: Node, a: dict[str, Any]) -> None:
        self._unary(i, n, "0.0f")

    _relu2 = _silu  # the same loop; _UNARY names each op's case

    def _split(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        parts, at = [], 0
        for size in a["sizes"]:
            parts.append(x.column(at, _int(size, "split size")))
            at += size
        if at != x.width:
            raise Refused(f"%{n.name}: split of {x.width} into {a['sizes']}")
        self.keep(n, tuple(parts))

    def _concat(self, i: int, n: Node, a: dict[str, Any]) -> None:
        parts = [self.buf(x) for x in n.args]
        rows = {p.rows for p in parts}
        if len(rows) != 1:
            raise Refused(f"%{n.name}: concat of values over {sorted(rows)} rows")
        out = self.new(n, sum(p.width for p in parts), parts[0].rows)
        at = 0
        for p in parts:
            self.emit(
                i,
                f"step_copy({p.expr}, {p.stride}, {p.width}, {p.rows}, {out.expr} + {at}, "
                f"{out.stride})",
                checked=False,
            )
            at += p.width
        self.keep(n, out)

    def _step_hidden(self, i: int, n: Node, a: dict[str, Any]) -> None:
        if self.buf(n.args[0]).rows != "M":
            raise Refused(f"%{n.name}: hidden states of other than the step's rows")
        width = _int(a["features"], "step_hidden features")
        if self.hidden_in not in (0, width):
            raise Refused(f"%{n.name}: a second width of hidden states read")
        self.hidden_in = width
        self.keep(n, Buf("s->hidden_in", width, width, "M"))

    def _index_select(self, i: int, n: Node, a: dict[str, Any]) -> None:
        x = self.buf(n.args[0])
        if self.values.get(id(n.args[1])) != "s->logits_rows" or x.rows != "M":
            raise Refused(f"%{n.name}: index_select of other than the logits rows")
        out = self.new(n, x.width, "R")
        self.emit(
            i,
            f"step_gather({x.expr}, {x.stride}, {x.width}, M, s->logits_rows, R, {out.expr})",
        )
        self.keep(n, out)

    # -- the text -------------------------------------------------------------------------
    def source(self) -> str:
        sizes = ", ".join(str(b) for b in self.weight_bytes) or "0"
        widths = ", ".join(str(d) for d in self.rope_widths) or "0"
        nodes = ", ".join(str(i) for i in self.call_nodes) or "0"
        hooks = ", ".join(str(w) for w in self.lora_hooks) or "0"
        head = [
            "/* A step, generated by kiln's compiler from the artefact's graph",
            " * (compiler/lower_step.py); the kernels are cpu_kernels.c's. */",
            HEADER.read_text(),
            f"static const int64_t WEIGHT_BYTES[] = {{{sizes}}};",
            f"int64_t kiln_step_abi(void) {{ return {native.STEP_ABI}; }}",
            f"int64_t kiln_step_arena_width(void) {{ return {max(self.arena.width, 1)}; }}",
            f"int64_t kiln_step_weights(void) {{ return {len(self.weights)}; }}",
            f"int64_t kiln_step_logits_width(void) {{ return {self.logits_width}; }}",
            f"int64_t kiln_step_hidden_width(void) {{ return {self.hidden_width}; }}",
            f"int64_t kiln_step_hidden_rows(void) {{ return {self.hidden_rows}; }}",
            f"int64_t kiln_step_hidden_in_width(void) {{ return {self.hidden_in}; }}",
            f"int64_t kiln_step_pool_floats(void) {{ return {self.pool_floats}; }}",
            f"int64_t kiln_step_kv_format(void) {{ return {self.kv_format}; }}",
            f"static const int64_t ROPE_WIDTHS[] = {{{widths}}};",
            f"int64_t kiln_step_rope_tables(void) {{ return {len(self.rope_widths)}; }}",
            f"static const int64_t CALL_NODES[] = {{{nodes}}};",
            f"int64_t kiln_step_calls(void) {{ return {self.calls}; }}",
            "int64_t kiln_step_call_node(int64_t c) {",
            f"    return c >= 0 && c < {self.calls} ? CALL_NODES[c] : -1;",
            "}",
            "int64_t kiln_step_rope_width(int64_t j) {",
            f"    return j >= 0 && j < {len(self.rope_widths)} ? ROPE_WIDTHS[j] : -1;",
            "}",
            f"static const int64_t LORA_HOOKS[] = {{{hooks}}};",
            f"int64_t kiln_step_lora_hooks(void) {{ return {len(self.lora_hooks)}; }}",
            "int64_t kiln_step_lora_weight(int64_t h) {",
            f"    return h >= 0 && h < {len(self.lora_hooks)} ? LORA_HOOKS[h] : -1;",
            "}",
            "int64_t kiln_step_weight_bytes(int64_t i) {",
            f"    return i >= 0 && i < {len(self.weights)} ? WEIGHT_BYTES[i] : -1;",
            "}",
            "",
            "int kiln_step_run(kiln_step_args *s) {",
            "    const int64_t M = s->rows, R = s->out_rows;",
            "    const int T = (int)s->threads;",
            "    const void *const *W = s->w;",
            "#define A(off) (s->arena + (int64_t)(off) * s->cap)",
            "    if (M < 1 || M > s->cap || R < 0 || R > M) return -3;",
            "    (void)R; (void)W;",
            "    STEP_TICK(-1);",
        ]
        return "\n".join([*head, *self.lines, "#undef A", "    return 0;", "}", ""])


# Graph ops whose native form is a loop of kiln_step.h rather than a kiln_cpu kernel.
_TORCH_NATIVE = frozenset(
    {"rope_cos_sin", "embedding", "add", "mul", "scale", "silu", "relu2"}
    | {"split", "index_select", "concat", "step_hidden"}
)
