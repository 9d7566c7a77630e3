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
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from kiln.compiler.ir import Node
from kiln.paths import cache_dir
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
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None


def inductor_cache() -> None:
    """Inductor's cache under kiln's (it moves with KILN_CACHE_DIR); torch reads the
    variable on each lookup."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


class CompiledDecode(DecodeBuckets):
    """Decode buckets run as Inductor-compiled pieces with eager attention between them."""

    def __init__(
        self, graph: Any, weights: dict[str, torch.Tensor], lib: Any, plan: dict[str, Any]
    ) -> None:
        from kiln.runtime.executor import generate_piecewise

        super().__init__(plan["decode"]["batch_sizes"])
        inductor_cache()
        import torch._dynamo

        # One compiled variant per bucket and distinct piece; past this limit dynamo would
        # quietly fall back to eager.
        limit = len(self.sizes) + 2
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        self.pieces = 0
        source, env = generate_piecewise(
            graph, weights, lib, set(plan["split_at"]), self._compile, _opaque
        )
        exec(compile(source, "<kiln pieces>", "exec"), env)
        self._forward: Callable[..., Any] = env["forward"]

    def _compile(self, fn: Callable[..., Any], key: tuple[Any, ...]) -> Callable[..., Any]:
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
    from kiln.kernels import registry

    native = registry.get(node.op, node.meta["backend"]).native
    if native or node.op in OPAQUE_OPS:
        return torch.compiler.disable(kernel, recursive=True)
    return kernel


# A recorder turns a step function into its replay: `record(fn)` returns a callable that
# runs the recorded step again on whatever the step buffers hold, returning its output.
Recorder = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def eager_recorder(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Replay by calling the step again (the CPU stand-in for a CUDA graph)."""
    return fn


def cuda_recorder(device: torch.device) -> Recorder:
    """CUDA graphs sharing one memory pool: warm up on a side stream, then record."""
    pool = torch.cuda.graph_pool_handle()

    def record(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return record


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
                self.replays[b] = self.record(fn)
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
