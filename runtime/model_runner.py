"""The model runner owns device state (weights, KV cache, step buffers) and runs one batch
per call.

A step is flattened into `StepInputs` (runtime/step.py: token ids, positions, logits rows,
each sequence's lengths and pages) so that a tensor-parallel rank 0 can send it to the other
ranks (runtime/parallel.py), which run the same step on their own weights and KV heads. The
step's `StepContext` writes it into preallocated buffers; a step the capture plan covers is
padded to its bucket there and its extra logits rows dropped here."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.core.artefact import ArtefactError
from kiln.runtime.artefact import Artefact
from kiln.runtime.kv_cache import KVCache, PagePool
from kiln.runtime.native_step import NativeStep
from kiln.runtime.sampler import Logits
from kiln.runtime.scheduler import Batch
from kiln.runtime.step import StepContext, StepInputs

if TYPE_CHECKING:
    from kiln.runtime.capture import CompiledDecode, GraphDecode, PiecewisePrefill, Recorder
    from kiln.runtime.executor import Executor
    from kiln.runtime.lora import LoraBank
    from kiln.runtime.parallel import TPGroup


def freeze_startup_heap(collect: bool = True) -> int:
    """Exempt what a long-running engine process built at startup (the modules, the
    model's graph, the tokenizer, the app: ~215,000 objects serving the tiny test model)
    from the cyclic garbage collector, and return how many objects that is. Every full
    collection walked them all holding the GIL, 66-180 ms on a Xeon core and over half a
    second on a slow CI machine: a stall of the HTTP loop (/health included) and of the
    engine's step alike. Objects made later are collected as before. The server and each
    tensor-parallel rank worker call it once their warm-up is done.

    `collect`: free the startup's unreachable cycles first, with one more such walk (70-140
    ms of a server's start, on a Xeon core). A process that only imported and loaded an
    artefact (`kiln serve`, a rank worker) passes False: its startup leaves ~40 unreachable
    objects (ctypes' and typing's, no tensors; measured serving SmolLM2), frozen with the
    rest. One that may have compiled, traced or tested in-process first keeps the default.
    The collector is on afterwards (`kiln serve` turns it off for its start)."""
    if collect:
        gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


class ModelRunner:
    def __init__(
        self, art: Artefact, max_total_tokens: int, context_length: int | None = None
    ) -> None:
        spec = art.spec
        self.spec = spec
        self.art = art
        self.device = art.device
        self.context_length = context_length or spec.context_length
        self.pick_rope_tables()
        self._executor: Executor | None = None
        self.pool = PagePool(max(1, max_total_tokens // spec.page_size), spec.page_size)
        # One page past the pool's: the scratch page padding rows write to (runtime/step.py).
        self.kv = KVCache(
            spec.num_layers,
            (self.pool.num_pages + 1) * spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.kv_dtype,
            self.device,
            spec.v_head_dim,
        )
        self.step = StepContext.over(self.kv, spec.page_size)
        self._recorder: Recorder | None = None
        # The last step's second output: --enable-return-hidden-states' final hidden states,
        # one row per logits row (what `run` returned the logits of); an EAGLE model's
        # every row's hidden states for its head; an EAGLE head's own, per logits row
        self.hidden: Any = None
        # An EAGLE head's: the width of the hidden state each fed token comes with
        self.hidden_in = next(
            (n.attrs["features"] for n in art.graph.nodes if n.op == "step_hidden"), 0
        )
        self.decode = self._decode_runner(art, context_length or spec.context_length)
        self.prefill = self._prefill_runner(art)
        self.group: TPGroup | None = None  # rank 0 of a tensor-parallel artefact
        # --enable-lora: the adapters' deltas (runtime/lora.py), and the executor that adds
        # them in steps with an adapter's rows that the native step does not run
        self.lora: LoraBank | None = None
        self._lora_executor: Executor | None = None
        self.native_lora = False  # adapters' steps run natively (enable_lora)

    def pick_rope_tables(self) -> None:
        """LongRoPE's table for the context served, into the weights (at start, and after
        new weights were copied in: runtime/weight_update.py)."""
        _pick_rope_tables(self.art, self.context_length)

    def enable_lora(self, bank: LoraBank) -> None:
        """Serve `bank`'s adapters: through the native step when it has a LoRA hook after
        each linear they may touch, else through the executor."""
        self.lora = bank
        self._lora_executor = None
        self.native_lora = isinstance(self.decode, NativeStep) and self.decode.take_lora(bank)

    @property
    def executor(self) -> Executor:
        """The Python executor over the graph: made when a step first needs it (the first
        step the native step does not run, if any: it imports torch)."""
        if self._executor is None:
            from kiln.runtime.executor import Executor

            self._executor = Executor(self.art.graph, self.art.weights, self.art.lib)
        return self._executor

    def forward(self, batch: Batch, all_logits: bool = False, hidden: Any = None) -> Logits:
        """Logits of the last fed token of each request that samples this step, and of
        every fed token of each scored one (`Batch.rows`, in batch order), or of every fed
        token when `all_logits`: a numpy array from the native step (runtime/sampler.py
        `Logits`). `hidden`: an EAGLE head's, each fed token's hidden state."""
        step = self.inputs(batch, all_logits)
        step.hidden = hidden
        if self.group is not None:
            self.group.send(step)
        return self.run(step)

    @staticmethod
    def inputs(batch: Batch, all_logits: bool = False) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        q_lens, kv_lens, counts, pages = [], [], [], []
        slots = [req.adapter for req in batch.requests]
        if batch.verify:
            # Each fed token a decode row of its own over its request's pages, its KV
            # length ending at its position (runtime/speculative.py): every row's logits.
            for req, fed in zip(batch.requests, batch.new_tokens, strict=True):
                for j, token in enumerate(fed):
                    ids.append(token)
                    positions.append(req.kv_len + j)
                    q_lens.append(1)
                    kv_lens.append(req.kv_len + j + 1)
                    counts.append(len(req.pages))
                    pages += req.pages
            rows = list(range(len(ids)))
            # each fed token its own sequence, of its request's adapter
            per_token = [s for s, fed in zip(slots, batch.new_tokens, strict=True) for _ in fed]
            adapters = per_token if any(slots) else None
            return StepInputs(ids, positions, rows, q_lens, kv_lens, counts, pages, adapters)
        for req, fed, count in zip(batch.requests, batch.new_tokens, batch.rows(), strict=True):
            kv_len = req.kv_len + len(fed)
            ids += fed
            positions += range(req.kv_len, kv_len)
            last += range(len(ids) - count, len(ids))  # the last token's, or every one's
            q_lens.append(len(fed))
            kv_lens.append(kv_len)
            counts.append(len(req.pages))
            pages += req.pages
        rows = list(range(len(ids))) if all_logits else last
        return StepInputs(
            ids, positions, rows, q_lens, kv_lens, counts, pages, slots if any(slots) else None
        )

    def warm_up(self) -> None:
        """Compile or record the capture plan's decode buckets, then its prefill buckets
        (every rank of a tensor-parallel artefact calls this once its process group is up)."""
        if self.decode is not None:
            self.decode.warm_up(self.step)
        if self.prefill is not None:
            self.prefill.warm_up(self.step)

    def time_decode(self, rows: Iterable[int], kv: int = 1, repeats: int = 3) -> dict[int, float]:
        """Seconds of a decode step of each row count (the best of `repeats`, after one
        untimed run), every row attending to `kv` cached tokens of one sequence: pages
        borrowed from the pool and given back (at kv 1, the scratch page), so no
        request's K/V is touched. For the speculative planner (runtime/speculative.py)."""
        pages = [self.step.pad_page] if kv == 1 else self.pool.allocate(self.pool.pages_for(kv))
        times = {}
        try:
            for m in rows:
                step = StepInputs(
                    [0] * m, [kv - 1] * m, list(range(m)), [1] * m, [kv] * m,
                    [len(pages)] * m, pages * m,
                )  # fmt: skip
                if self.hidden_in:
                    step.hidden = np.zeros((m, self.hidden_in), dtype=np.float32)
                best = math.inf
                for i in range(repeats + 1):
                    start = time.perf_counter()
                    if self.group is not None:
                        self.group.send(step)
                    self.run(step)
                    if i:
                        best = min(best, time.perf_counter() - start)
                times[m] = best
        finally:
            if kv > 1:
                self.pool.free(pages)
        return times

    def run(self, step: StepInputs) -> Logits:
        # A step with an adapter's rows runs in the native step's LoRA hooks, or in the
        # executor whose linears add the deltas (runtime/lora.py), never in a recording.
        lora = step.adapters is not None
        bucket = None if self.decode is None else self.decode.bucket(step)
        if bucket is not None and (not lora or self.native_lora):
            assert self.decode is not None
            logits = self.decode.run(self.step, step, bucket)
            if isinstance(self.decode, NativeStep) and self.decode.hidden_width:
                self.hidden = self.decode.hidden  # a second output (of the rows it ran)
            # a padded bucket's extra rows go (the native step has none: no op to pay)
            return logits if len(logits) == len(step.rows) else logits[: len(step.rows)]
        tokens = None if lora or self.prefill is None else self.prefill.bucket(step)
        if tokens is not None:
            assert self.prefill is not None
            return self.prefill.run(self.step, step, tokens)
        ctx, ids, positions, rows = self.step.plan(step)
        if step.hidden is not None:  # an EAGLE head's step
            import torch

            ctx.hidden = torch.from_numpy(step.hidden)
        if lora:
            from kiln.runtime.lora import step_groups

            assert step.adapters is not None
            ctx.lora = step_groups(step.adapters, step.q_lens, self.device)
        out = (self.lora_executor if lora else self.executor)(ctx, ids, positions, rows)
        if isinstance(out, tuple):  # --enable-return-hidden-states: (logits, hidden)
            out, self.hidden = out
        return out

    @property
    def lora_executor(self) -> Executor:
        """The executor whose linears add the adapters' deltas (made at first use)."""
        from kiln.runtime.executor import Executor

        assert self.lora is not None
        if self._lora_executor is None:
            art = self.art
            self._lora_executor = Executor(art.graph, art.weights, art.lib, self.lora.wrap)
        return self._lora_executor

    def decode_mode(self, art: Artefact) -> str:
        """How decode steps run, for the start-up log: a slow mode says why."""
        if isinstance(self.decode, NativeStep):
            return "native step"
        if self.decode is not None:  # one of runtime/capture.py's, which it imported
            from kiln.runtime.capture import GraphDecode

            return "CUDA graphs" if isinstance(self.decode, GraphDecode) else "compiled pieces"
        plan = art.graph.plan or {}
        if plan.get("decode", {}).get("mode") == "native":
            return "Python executor (the native step library was not loaded)"
        why = plan.get("decode", {}).get("native_refused")
        return f"Python executor ({why})" if why else "Python executor"

    def _decode_runner(
        self, art: Artefact, context_length: int
    ) -> CompiledDecode | GraphDecode | NativeStep | None:
        """How the capture plan's decode buckets run here (runtime/capture.py), or every
        decode step through the native step (runtime/native_step.py)."""
        plan = art.graph.plan
        mode = plan["decode"]["mode"] if plan else "eager"
        if mode == "native":
            if art.step_lib is None:  # not lowered, or not trusted (open_step warned)
                return None
            info = art.manifest["native_step"]
            assert art.host is not None  # a native step is a CPU artefact's
            return NativeStep(
                art.step_lib, art.lib, info, art.graph, art.host, self.kv, self.spec.page_size
            )
        if plan is None or mode == "eager" or not plan["decode"]["batch_sizes"]:
            return None
        from kiln.runtime.capture import CompiledDecode, GraphDecode

        if mode == "compiled":
            return CompiledDecode(art.graph, art.weights, art.lib, plan)
        max_pages = min(self.pool.num_pages, self.pool.pages_for(context_length))
        return GraphDecode(self.executor, self.step, plan, max_pages, self.recorder())

    def _prefill_runner(self, art: Artefact) -> PiecewisePrefill | None:
        """The plan's piecewise prefill buckets (a CUDA target's, runtime/capture.py)."""
        plan = art.graph.plan
        if plan is None or plan["prefill"]["mode"] != "piecewise":
            return None
        from kiln.runtime.capture import PiecewisePrefill

        return PiecewisePrefill(art.graph, art.weights, art.lib, plan, self.recorder())

    def recorder(self) -> Recorder:
        """One CUDA-graph recorder (one memory pool) for every recording of this runner."""
        if self._recorder is None:
            from kiln.runtime.capture import cuda_recorder

            self._recorder = cuda_recorder(self.kv.k.device)
        return self._recorder


def _pick_rope_tables(art: Artefact, context_length: int) -> None:
    """LongRoPE: serving past the pretraining context takes the long factors' table in
    place of the short one the graph was written with (the manifest's `long_rope`)."""
    for entry in art.spec.long_rope:
        if context_length <= entry["context_above"]:
            continue
        name = entry["weight"]
        new = np.array(entry["inv_freq"], dtype=np.float32)
        if art.host is not None:  # the weights' one copy: torch's tensors are views of it
            old = art.host.get(name)
            if old is None or old.shape != new.shape or art.host.dtype(name) != "float32":
                raise ArtefactError(f"long_rope: {name} is not a rope table of {new.size}")
            old[...] = new
            continue
        tensor = art.weights.get(name)
        if tensor is None or tuple(tensor.shape) != new.shape:
            raise ArtefactError(f"long_rope: {name} is not a rope table of {new.size}")
        import torch

        tensor.copy_(torch.from_numpy(new))
