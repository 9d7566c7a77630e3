"""Running the capture plan (passes/capture_plan.py) that the compiler stored.

A decode step whose size has a bucket in the plan runs padded to that bucket
(runtime/step.py pads it; the runner drops the extra logits rows); any other step, every
prefill among them, runs the plain executor.

- "compiled" (`--enable-torch-compile`; a CPU target's only mode): the graph cut at its
  attention ops (the plan's `split_at`) into pieces; each piece compiled by Inductor for
  each bucket, the attention run eagerly between them. Decoder layers share one compiled
  piece (runtime/executor.py `generate_piecewise`). Kernels a compiler cannot look into
  (kiln's C kernels, collectives, the MoE's per-expert loop) stay opaque calls. Inductor's
  output goes to `$KILN_CACHE_DIR/inductor` (Inductor's own cache: code generated on this
  machine, never read from the artefact), so a second start does not compile again.
- "cuda_graph" (a CUDA target): the whole step of each bucket recorded once into a
  `torch.cuda.CUDAGraph` over the runner's fixed step buffers, all graphs sharing one
  memory pool, largest bucket first; a step writes its inputs into the buffers and replays.
  Only `cuda_recorder` touches CUDA: the tests run the same runner with a recorder that
  calls the step eagerly at replay, on the CPU.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.core.ir import Node
from kiln.kernels import catalog
from kiln.paths import cache_dir
from kiln.runtime.executor import PieceInfo, backend_of, generate_piecewise
from kiln.runtime.step import StepContext, StepInputs

log = logging.getLogger("kiln.capture")

# Ops whose kernels stay opaque calls inside a compiled piece.
OPAQUE_OPS = frozenset({"moe", "all_reduce", "all_gather"})


def empty_step() -> StepInputs:
    """A step of no sequences: padded to a bucket it is all dummy rows (warm-up, capture)."""
    return StepInputs([], [], [], [], [], [], [])


class DecodeBuckets:
    """The plan's decode batch sizes; a step's bucket is the smallest that holds it."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self.ready = False  # set by warm_up: until then every step runs eagerly

    def bucket(self, step: StepInputs) -> int | None:
        """The bucket of a decode step whose every row samples, else None (eager)."""
        n = len(step.ids)
        if not self.ready or not n or not step.decode or len(step.rows) != n:
            return None
        return smallest_holding(self.sizes, n)


def smallest_holding(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` that is at least `n`, else None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def inductor_cache() -> None:
    """Inductor's cache under kiln's (it moves with KILN_CACHE_DIR); torch reads the
    variable on each lookup."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


class CompiledDecode(DecodeBuckets):
    """Decode buckets run as Inductor-compiled pieces with eager attention between them."""

    def __init__(
        self, graph: Any, weights: dict[str, torch.Tensor], lib: Any, plan: dict[str, Any]
    ) -> None:
        super().__init__(plan["decode"]["batch_sizes"])
        inductor_cache()
        import torch._dynamo

        # One compiled variant per bucket and distinct piece; past this limit dynamo would
        # quietly fall back to eager.
        limit = len(self.sizes) + 2
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        self.pieces = 0
        program = generate_piecewise(
            graph, weights, lib, set(plan["split_at"]), self._compile, _opaque
        )
        self._forward: Callable[..., Any] = program.fn

    def _compile(
        self, fn: Callable[..., Any], key: tuple[Any, ...], info: PieceInfo
    ) -> Callable[..., Any]:
        self.pieces += 1
        return torch.compile(fn, dynamic=False)

    def warm_up(self, step: StepContext) -> None:
        """Compile every bucket now (or load it from Inductor's cache), not on a request.
        Tensor-parallel ranks all call this at start, so their collectives pair up."""
        for b in self.sizes:
            t = time.perf_counter()
            self.run(step, empty_step(), b)
            log.info("decode bucket %d compiled in %.1fs", b, time.perf_counter() - t)
        self.ready = True

    @torch.inference_mode()
    def run(self, step: StepContext, inputs: StepInputs, bucket: int) -> torch.Tensor:
        ctx, ids, positions, rows = step.plan(inputs, bucket)
        return self._forward(ctx, ids, positions, rows)


def _opaque(node: Node, kernel: Callable[..., Any]) -> Callable[..., Any]:
    native = catalog.get(node.op, backend_of(node, "decode")).native
    if native or node.op in OPAQUE_OPS:
        return torch.compiler.disable(kernel, recursive=True)
    return kernel


# A recorder turns a step function into its replay: `record(fn, weak)` returns a callable
# that runs the recorded work again on whatever its input buffers hold, returning its
# output. `weak`: the output may be read only until the next replay of any recording (its
# memory goes back to the shared pool, where a later recording may reuse it).
Recorder = Callable[[Callable[[], Any], bool], Callable[[], Any]]


def eager_recorder(fn: Callable[[], Any], weak: bool = False) -> Callable[[], Any]:
    """Replay by calling the step again (the CPU stand-in for a CUDA graph)."""
    return fn


def cuda_recorder(device: torch.device) -> Recorder:
    """CUDA graphs sharing one memory pool: warm up on a side stream, then record."""
    pool = torch.cuda.graph_pool_handle()

    def record(fn: Callable[[], Any], weak: bool = False) -> Callable[[], Any]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        if weak:
            out = _map(unowned, out)

        def replay() -> Any:
            graph.replay()
            return out

        return replay

    return record


class _Borrowed:
    """A tensor's bytes as an array interface that does not own them."""

    def __init__(self, t: torch.Tensor) -> None:
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        face = {
            "shape": (span * t.element_size() if t.numel() else 0,),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
        }
        name = "__cuda_array_interface__" if t.is_cuda else "__array_interface__"
        setattr(self, name, face)


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep it allocated: the output of a recorded
    piece, whose memory the pool may give to a later recording."""
    borrowed = _Borrowed(t)
    if t.is_cuda:
        raw = torch.as_tensor(borrowed, device=t.device)
    else:
        raw = torch.from_numpy(np.asarray(borrowed))
    return raw.view(t.dtype).as_strided(t.shape, t.stride())


class GraphDecode(DecodeBuckets):
    """Decode buckets recorded once over fixed step buffers and replayed."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        step: StepContext,
        plan: dict[str, Any],
        max_pages: int,
        record: Recorder,
    ) -> None:
        super().__init__(plan["decode"]["batch_sizes"])
        self.forward, self.max_pages, self.record = forward, max_pages, record
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    def warm_up(self, step: StepContext) -> None:
        """Record every bucket, largest first (the pool then fits the rest)."""
        biggest = self.sizes[-1]
        # The buffers must not move once a graph has recorded their addresses.
        step.reserve(biggest, biggest, self.max_pages)
        with torch.inference_mode():
            for b in reversed(self.sizes):
                fn = _step_fn(self.forward, *step.plan(empty_step(), b, fixed=True))
                self.replays[b] = self.record(fn, False)
        self.ready = True

    @torch.inference_mode()
    def run(self, step: StepContext, inputs: StepInputs, bucket: int) -> torch.Tensor:
        step.plan(inputs, bucket, fixed=True)
        # The recorded output is overwritten by the next replay.
        return self.replays[bucket]().clone()


def _step_fn(
    forward: Callable[..., torch.Tensor],
    ctx: Any,
    ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
) -> Callable[[], torch.Tensor]:
    def fn() -> torch.Tensor:
        # Masks are computed from the buffers inside the step (a graph records that work);
        # one cached from an earlier replay would be stale.
        ctx._masks.clear()
        return forward(ctx, ids, positions, rows)

    return fn


class PiecewisePrefill:
    """Steps that are not a recorded decode (prefills, extends, mixed chunks) of up to the
    plan's largest token bucket run at their bucket of tokens: each piece between two
    attentions recorded once per bucket and call site (a recording holds its weights'
    addresses), reading its inputs from buffers that outlive it; the attentions run eagerly
    on the step's real tokens between the pieces, and so does the tail from the plan's
    `eager_from` node (the logits rows, whose count no bucket fixes).

    Padding needs no dummy sequence: a piece's input buffer takes the step's rows at its
    head and keeps, below them, finite rows from earlier steps (zeros at first). Every op
    in a piece works row by row, so those rows change no real row, and the attentions and
    the KV cache never see them. A piece's outputs are `weak` (runtime/capture.py
    `Recorder`): an output still read after the next piece has run is copied out first.
    """

    def __init__(
        self,
        graph: Any,
        weights: dict[str, torch.Tensor],
        lib: Any,
        plan: dict[str, Any],
        record: Recorder,
    ) -> None:
        prefill = plan["prefill"]
        self.sizes = sorted(prefill["tokens"])
        self.record = record
        self.ready = False
        self.bucket_now = self.tokens_now = 0
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.recordings = 0
        program = generate_piecewise(
            graph,
            weights,
            lib,
            set(plan["split_at"]),
            self._piece,
            make_split=self._real_rows,
            eager_from=prefill["eager_from"],
            share=False,
            phase="prefill",
        )
        self._forward: Callable[..., Any] = program.fn

    def bucket(self, step: StepInputs) -> int | None:
        n = len(step.ids)
        return smallest_holding(self.sizes, n) if self.ready and n else None

    def warm_up(self, step: StepContext) -> None:
        """Record every bucket, largest first, on a one-sequence prefill of the bucket's
        length over the scratch page (its K/V land there and nowhere else)."""
        for b in reversed(self.sizes):
            t = time.perf_counter()
            pages = -(-b // step.page_size)
            dummy = StepInputs(
                [0] * b, list(range(b)), [b - 1], [b], [b], [pages], [step.pad_page] * pages
            )
            self.run(step, dummy, b)
            log.info("prefill bucket %d recorded in %.2fs", b, time.perf_counter() - t)
        self.ready = True

    @torch.inference_mode()
    def run(self, step: StepContext, inputs: StepInputs, bucket: int) -> torch.Tensor:
        ctx, ids, positions, rows = step.plan(inputs)
        self.bucket_now, self.tokens_now = bucket, len(inputs.ids)
        return self._forward(ctx, ids, positions, rows)

    def buffer(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """The input buffer of a piece's `slot`-th value at the current bucket: one per
        slot, row shape and dtype, sized for the largest bucket and shared by every piece
        (pieces run one after another and each fills its buffers just before it runs)."""
        key = (slot, tuple(like.shape[1:]), like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None:
            buf = torch.zeros(
                (self.sizes[-1], *like.shape[1:]), dtype=like.dtype, device=like.device
            )
            self.buffers[key] = buf
        return buf[: self.bucket_now]

    def _piece(
        self, fn: Callable[..., Any], key: tuple[Any, ...], info: PieceInfo
    ) -> Callable[..., Any]:
        if info.ctx:
            raise ValueError("a piece between two attentions reads the step context")
        return _RecordedPiece(self, fn, info)

    def _real_rows(self, fn: Callable[..., Any], info: PieceInfo) -> Callable[..., Any]:
        """An attention between pieces, on the step's real tokens only."""

        def real_rows(*args: Any) -> Any:
            head = int(info.ctx)
            n = self.tokens_now
            values = [_map(lambda t: t[:n], a) for a in args[head : head + info.values]]
            return fn(*args[:head], *values, *args[head + info.values :])

        return real_rows


class _RecordedPiece:
    """One call site's piece: recorded per bucket on its first call there (warm-up), then
    replayed after its inputs are copied into the runner's buffers."""

    def __init__(self, owner: PiecewisePrefill, fn: Callable[..., Any], info: PieceInfo) -> None:
        self.owner, self.fn, self.info = owner, fn, info
        # per bucket: the input buffers (flattened once), the replay, which outputs to copy
        self.replays: dict[int, tuple[list[torch.Tensor], Callable[[], Any], tuple[bool, ...]]] = {}

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        owner, n = self.owner, self.info.values
        bucket = owner.bucket_now
        values, weights = args[:n], args[n:]
        entry = self.replays.get(bucket)
        if entry is None:
            if owner.ready:
                raise RuntimeError(f"prefill bucket {bucket} was not recorded")
            slot = itertools.count()
            inputs = [_map(lambda t: owner.buffer(next(slot), t), v) for v in values]
            buffers = _leaves(inputs)
            _fill(buffers, values)
            fn = self.fn

            def step() -> Any:
                return fn(*inputs, *weights)

            replay = owner.record(step, True)
            outs = replay()
            # Copied out after each replay: outputs read after the next piece has run, and
            # any that is a view of an input buffer (the next piece refills those).
            copy = tuple(
                keep or any(_overlaps(t, buf) for t in _leaves(o) for buf in buffers)
                for o, keep in zip(outs, self.info.keep, strict=True)
            )
            entry = self.replays[bucket] = (buffers, replay, copy)
            owner.recordings += 1
        else:
            _fill(entry[0], values)
            outs = entry[1]()
        return tuple(_map(torch.clone, o) if c else o for o, c in zip(outs, entry[2], strict=True))


def _map(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """`fn` on each tensor of a value (a tensor, or a tuple of them: rope's cos and sin)."""
    if isinstance(value, tuple | list):
        return tuple(_map(fn, v) for v in value)
    return fn(value) if isinstance(value, torch.Tensor) else value


def _leaves(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(found.append, value)
    return found


def _fill(buffers: list[torch.Tensor], values: tuple[Any, ...]) -> None:
    """Each tensor of `values` into the head rows of its buffer (`buffers`: flattened)."""
    for buf, v in zip(buffers, _leaves(values), strict=True):
        if v.shape[0] > buf.shape[0]:
            raise ValueError(f"{v.shape[0]} rows do not fit a bucket of {buf.shape[0]}")
        buf[: v.shape[0]].copy_(v)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    start, end = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return a.device == b.device and start <= a.data_ptr() < end
