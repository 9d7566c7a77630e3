"""Running an artefact's native step (compiler/lower_step.py): one C call a step.

`NativeStep` binds the step library once per runner: the kernel table from the artefact's
kiln_cpu library, the weights' addresses in the order the manifest lists them (each
checked against the byte size the step was generated for), the KV pool (checked to hold
every layer the step reaches) and an activation arena that grows with the largest step
seen. Every step, decode, prefill, extend or mixed, is rows: each new token one row that
attends to its sequence's keys up to its own (runtime/step.py `plan_rows`), so a prefill
is the decode step's code over more rows, and the attention kernel scores a sequence's
rows together (kernels/csrc/cpu_kernels.c, attend_runs). A step fills one
`kiln_step_args` and calls `kiln_step_run`; logits come back in a fresh numpy array. An
artefact whose step was not lowered or not loaded runs every step in the Python executor,
which stays the reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core.artefact import ArtefactError
from kiln.core.ir import Graph
from kiln.core.ops.rope import Tables
from kiln.kernels import native
from kiln.kernels.cpu import KernelError
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.step import StepContext, StepInputs
from kiln.runtime.threads import threads

ROPE_BLOCK = 1024  # positions the rotary tables grow by
LORA_BLOCK = 8  # kiln_step.h LORA_BLOCK: rows a LoRA hook takes together


class KernelTable(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in native.STEP_KERNELS]


class StepArgs(ctypes.Structure):
    """kernels/csrc/kiln_step.h `kiln_step_args`, field for field."""

    _P, _I = ctypes.c_void_p, ctypes.c_int64
    _fields_ = [
        ("k", _P),
        ("w", _P),
        ("arena", _P),
        ("cap", _I),
        ("rows", _I),
        ("out_rows", _I),
        ("ids", _P),
        ("positions", _P),
        ("logits_rows", _P),
        ("slots", _P),
        ("kv_index", _P),
        ("kv_lens", _P),
        ("kv_rows", _P),
        ("kv_pages", _I),
        ("page_size", _I),
        ("k_pool", _P),
        ("v_pool", _P),
        ("pool_slots", _I),
        ("rope", _P),
        ("rope_rows", _I),
        ("logits", _P),
        ("threads", _I),
        ("ticks", _P),
        ("failed_at", _I),
        ("lora", _P),
        ("hidden", _P),
        ("hidden_in", _P),
    ]


class LoraArgs(ctypes.Structure):
    """kernels/csrc/kiln_step.h `kiln_lora`, field for field."""

    _P, _I = ctypes.c_void_p, ctypes.c_int64
    _fields_ = [
        ("adapters", _I),
        ("a", _P),
        ("b", _P),
        ("bf16", _P),
        ("scale", _P),
        ("rank", _P),
        ("span", _P),
        ("blocks", _I),
        ("block", _P),
        ("act", _P),
        ("t", _P),
        ("t_stride", _I),
    ]


class _LoraTables:
    """The pointer tables of one set of adapters (kiln_lora's a, b, bf16, scale, rank and
    span), kept while the adapters stay as they are."""

    def __init__(self, hooks: list[Any], slots: tuple[int, ...]) -> None:
        n = max(1, len(hooks) * len(slots))
        self.a = (ctypes.c_void_p * n)()
        self.b = (ctypes.c_void_p * n)()
        self.bf16 = (ctypes.c_int64 * n)()
        self.scale = (ctypes.c_void_p * n)()
        self.rank = (ctypes.c_int64 * n)()
        self.span = (ctypes.c_void_p * n)()
        self.rank_max = 1  # the largest rank: each row's x A^T
        self.gated_in = 1  # the widest gated hook's input: its silu(gate) * up
        for h, linear in enumerate(hooks):
            for j, slot in enumerate(slots):
                delta = linear.deltas.get(slot)
                if delta is None:
                    continue
                at = delta.at  # A^T [in, rank]; B^T [rank, out]
                i = h * len(slots) + j
                self.a[i], self.b[i], self.rank[i] = at.data_ptr(), delta.bt.data_ptr(), at.shape[1]
                self.bf16[i] = int(at.element_size() == 2)  # bfloat16 (else float32)
                self.scale[i], self.span[i] = delta.scale.data_ptr(), delta.span.data_ptr()
                self.rank_max = max(self.rank_max, at.shape[1])
            if linear.prologue == "silu_and_mul":  # its input is made for every row
                self.gated_in = max(self.gated_in, linear.in_features)


class NativeStep:
    """Every step through the step library."""

    def __init__(
        self,
        step_lib: ctypes.CDLL,
        kernels: ctypes.CDLL,
        info: dict[str, Any],
        graph: Graph,
        weights: Mapping[str, np.ndarray],
        kv: KVCache,
        page_size: int,
    ) -> None:
        """`weights`: the artefact's, as host arrays (runtime/weights.py); `kv`: the
        runner's pool of `page_size` pages, whose host arrays the step reads and writes.
        Nothing here needs torch."""
        where = "the native step"  # of this kiln's ABI (native.load_step checked)
        names = list(info["weights"])
        if step_lib.kiln_step_weights() != len(names):
            raise ArtefactError(
                f"{where} takes {step_lib.kiln_step_weights()} weights, "
                f"the manifest lists {len(names)}"
            )
        arrays = []
        for i, name in enumerate(names):
            w = weights.get(name)
            want = step_lib.kiln_step_weight_bytes(i)
            if w is None or not w.flags.c_contiguous or w.nbytes != want:
                raise ArtefactError(
                    f"{where} reads {want} bytes of weight {name!r}; the artefact's does not match"
                )
            arrays.append(w)
        k_pool, v_pool = kv.k_host, kv.v_host
        per_slot = step_lib.kiln_step_pool_floats()  # elements
        kv_format = int(step_lib.kiln_step_kv_format())
        if native.KV_FORMATS.get(kv.dtype) != kv_format or k_pool is None or v_pool is None:
            raise ArtefactError(
                f"{where} runs on a host KV pool of format {kv_format} "
                "(kernels/native.py KV_FORMATS)"
            )
        for pool in (k_pool, v_pool):
            if not pool.flags.c_contiguous:
                raise ArtefactError(f"{where} runs on a contiguous KV pool")
            if pool.size < per_slot * pool.shape[2]:
                raise ArtefactError(f"{where} reaches past the KV pool")
        self.rope = [
            (Tables(**n.attrs), n.args[1].attrs["name"])
            for n in graph.nodes
            if n.op == "rope_cos_sin"
        ]
        if step_lib.kiln_step_rope_tables() != len(self.rope):
            raise ArtefactError(
                f"{where} reads {step_lib.kiln_step_rope_tables()} rotary tables, "
                f"the graph makes {len(self.rope)}"
            )
        self.graph = graph
        self.weights = weights
        self.lib = step_lib
        self.fn = step_lib.kiln_step_run
        # Prefill, extend and mixed steps too, where the capture plan says so.
        plan = graph.plan
        self.every_step = plan is not None and plan["prefill"]["mode"] == "native"
        self.width = int(step_lib.kiln_step_arena_width())
        self.vocab = int(step_lib.kiln_step_logits_width())
        # The step's second output (hidden states: every row's, or the logits rows') and
        # the hidden states an EAGLE head's step reads; `hidden`: the last step's output
        self.hidden_width = int(step_lib.kiln_step_hidden_width())
        self.hidden_every_row = bool(step_lib.kiln_step_hidden_rows())
        self.hidden_in = int(step_lib.kiln_step_hidden_in_width())
        self.hidden: np.ndarray | None = None
        self._arrays = arrays  # the weights the pointers below point into
        self._table = KernelTable(
            *(ctypes.cast(getattr(kernels, n), ctypes.c_void_p).value for n in native.STEP_KERNELS)
        )
        self._weights = (ctypes.c_void_p * max(1, len(arrays)))(*(_address(w) for w in arrays))
        self.arena = np.empty(0, np.float32)
        self.tables: list[np.ndarray] = []
        self._rope_ptrs = (ctypes.c_void_p * max(1, len(self.rope)))()
        # LoRA (runtime/lora.py): the weight of each hook the step has (kiln_step_lora_hooks)
        self.lora_hooks = [
            names[int(step_lib.kiln_step_lora_weight(h))]
            for h in range(int(step_lib.kiln_step_lora_hooks()))
        ]
        self._lora: Any = None  # the runner's LoraBank, once it serves adapters natively
        self._hooked: list[Any] = []  # its linear at each hook
        self._lora_tables: dict[tuple[int, ...], _LoraTables] = {}
        self._lora_version = -1
        self._lora_args = LoraArgs()
        self._lora_blocks = np.empty(0, np.int64)
        self._scratch = np.empty(0, np.float32)
        self.args = StepArgs()
        a = self.args
        a.k = ctypes.addressof(self._table)
        a.w = ctypes.addressof(self._weights)
        a.page_size = page_size
        a.k_pool, a.v_pool = _address(k_pool), _address(v_pool)
        a.pool_slots = k_pool.shape[2]
        a.rope = ctypes.addressof(self._rope_ptrs)
        a.threads = threads()
        self._pointer = ctypes.byref(a)

    def take_lora(self, bank: Any) -> bool:
        """Run adapters' steps here from now on, if this step has a hook after every linear
        `bank` may touch (a step lowered before kiln had hooks has none): True if so."""
        if set(self.lora_hooks) != set(bank.linears):
            return False
        self._lora = bank
        self._hooked = [bank.linears[name] for name in self.lora_hooks]
        return True

    def _lora_step(self, inputs: StepInputs) -> int:
        """The step's kiln_lora (its address), or 0 when no row has an adapter."""
        adapters = inputs.adapters
        if not adapters or self._lora is None:
            return 0
        bank = self._lora
        if bank.version != self._lora_version:  # an adapter came or went: new pointers
            self._lora_tables.clear()
            self._lora_version = bank.version
        slots = tuple(sorted({s for s in adapters if s}))
        tables = self._lora_tables.get(slots)
        if tables is None:
            tables = self._lora_tables[slots] = _LoraTables(self._hooked, slots)
        index = {s: j for j, s in enumerate(slots)}
        # blocks of at most LORA_BLOCK consecutive rows (new tokens) of one adapter
        blocks: list[int] = []
        row = 0
        for slot, q in zip(adapters, inputs.q_lens, strict=True):
            if slot:
                for start in range(row, row + q, LORA_BLOCK):
                    blocks += (start, min(LORA_BLOCK, row + q - start), index[slot])
            row += q
        self._lora_blocks = np.array(blocks, np.int64)
        need = row * (tables.gated_in + tables.rank_max)
        if self._scratch.size < need:
            self._scratch = np.empty(max(need, 2 * self._scratch.size), np.float32)
        la = self._lora_args
        la.adapters = len(slots)
        la.a, la.b = ctypes.addressof(tables.a), ctypes.addressof(tables.b)
        la.bf16, la.scale = ctypes.addressof(tables.bf16), ctypes.addressof(tables.scale)
        la.rank, la.span = ctypes.addressof(tables.rank), ctypes.addressof(tables.span)
        la.blocks, la.block = len(blocks) // 3, _address(self._lora_blocks)
        la.act = _address(self._scratch)
        la.t = la.act + 4 * row * tables.gated_in
        la.t_stride = tables.rank_max
        return ctypes.addressof(la)

    def bucket(self, step: StepInputs) -> int | None:
        return len(step.ids) if step.ids and (step.decode or self.every_step) else None

    def warm_up(self, step: StepContext) -> None:
        # The kernels' thread count as the engine has set it now (--threads, a
        # tensor-parallel rank's share: runtime/threads.py); read once, not every step.
        self.args.threads = threads()
        self._reserve(16)
        self._rope_reach(ROPE_BLOCK - 1)

    def _rope_reach(self, position: int) -> None:
        """Rotary tables through `position`, over every position up to the next ROPE_BLOCK
        (the step copies rows of them), grown as positions reach past them."""
        if position < self.args.rope_rows:
            return
        rows = max(2 * self.args.rope_rows, (position // ROPE_BLOCK + 1) * ROPE_BLOCK)
        tables = []
        for j, (attrs, inv_freq) in enumerate(self.rope):
            table = rope_table(rows, self.weights[inv_freq], attrs)
            if table.shape[2] != self.lib.kiln_step_rope_width(j):
                raise ArtefactError(f"the native step's rotary table {j} is not {table.shape}")
            tables.append(table)
            self._rope_ptrs[j] = _address(table)
        self.tables = tables
        self.args.rope_rows = rows

    def _reserve(self, rows: int) -> None:
        if rows > self.args.cap:
            cap = max(rows, 2 * self.args.cap)
            self.arena = np.empty(self.width * cap, np.float32)
            self.args.arena, self.args.cap = _address(self.arena), cap

    def run(self, step: StepContext, inputs: StepInputs, bucket: int) -> np.ndarray:
        buf, width = step.plan_rows(inputs)
        m, r = len(inputs.ids), len(inputs.rows)
        self._reserve(m)
        self._rope_reach(max(inputs.positions))
        logits = np.empty((r, self.vocab), np.float32)  # runtime/sampler.py `Logits`
        a = self.args
        a.rows, a.out_rows = m, r
        # plan_rows' parts, 8 bytes an entry: ids, positions (m each), logits rows (r), then
        # slots, KV lengths, page-table rows (m each), then the tables
        base = buf.buffer_info()[0]  # `buf` lives until the call returns
        a.ids, a.positions, a.logits_rows = base, base + 8 * m, base + 16 * m
        at = base + 8 * (2 * m + r)
        a.slots, a.kv_lens, a.kv_rows, a.kv_index = (at + 8 * m * i for i in range(4))
        a.kv_pages = width
        a.logits = _address(logits)
        a.hidden = a.hidden_in = None
        if self.hidden_width:
            self.hidden = np.empty(
                (m if self.hidden_every_row else r, self.hidden_width), np.float32
            )
            a.hidden = _address(self.hidden)
        if self.hidden_in:
            fed = inputs.hidden
            if fed is None or fed.shape != (m, self.hidden_in) or fed.dtype != np.float32:
                got = None if fed is None else (fed.shape, fed.dtype)
                raise ValueError(f"the step reads hidden states ({m}, {self.hidden_in}), got {got}")
            fed = np.ascontiguousarray(fed)
            a.hidden_in = _address(fed)  # `fed` lives until the call returns
        a.lora = self._lora_step(inputs) or None
        rc = self.fn(self._pointer)
        if rc != 0:
            raise self._error(rc)
        return logits

    def profile(self, on: bool = True) -> np.ndarray:
        """Clock readings of the next steps: [calls + 1] ns, before the first call and after
        each (benchmarks/step_profile.py reads them); `on=False` stops them."""
        self._ticks = np.zeros(int(self.lib.kiln_step_calls()) + 1, dtype=np.int64)
        self.args.ticks = _address(self._ticks) if on else None
        return self._ticks

    def call_nodes(self) -> list[int]:
        """Each call's node, by graph index."""
        return [int(self.lib.kiln_step_call_node(c)) for c in range(self.lib.kiln_step_calls())]

    def _error(self, rc: int) -> Exception:
        at = self.args.failed_at
        n = self.graph.nodes[at] if 0 <= at < len(self.graph.nodes) else None
        what = f"%{n.name} ({n.op})" if n is not None else "the step"
        if n is not None and n.op.endswith("embedding"):
            return KernelError(f"native step {what}: a token id is outside the vocabulary")
        if n is not None and n.op == "index_select":
            return KernelError(f"native step {what}: a logits row outside the step")
        if rc == -1:
            return MemoryError(f"native step {what}: out of memory for its scratch")
        return KernelError(f"native step {what}: failed ({rc})")


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def rope_table(rows: int, inv_freq: np.ndarray, a: Tables) -> np.ndarray:
    """rope_cos_sin's values (kiln/core/ops/rope.py) for positions 0..rows-1, to the bit,
    as [rows, 2, rotary_dim] float32 rows of (cos, signed sin): float32 angles, their cos
    and sin correctly rounded from float64, the attention factor applied in float32."""
    freqs = np.arange(rows, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    wide = freqs.astype(np.float64)
    cos, sin = np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)
    if a.scale != 1.0:
        factor = np.full_like(inv_freq, a.scale, dtype=np.float32)
        if a.scaled_pairs:
            factor[a.scaled_pairs :] = 1.0
        cos, sin = cos * factor, sin * factor
    half = cos.shape[1]
    table = np.empty((rows, 2, 2 * half), np.float32)
    table[:, 0, :half] = table[:, 0, half:] = cos
    table[:, 1, :half], table[:, 1, half:] = -sin, sin
    return table
