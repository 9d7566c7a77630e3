"""The step buffers, padding to the plan's buckets, the two ways a plan runs decode
(compiled pieces, Inductor on this CPU, and recorded steps) and the piecewise prefill. The
recorded runners are the CUDA-graph runners with a recorder that replays by calling the
step again (and, for prefill pieces, hands every replay's outputs the same memory, as a
shared CUDA pool may); only the CUDA capture call itself needs a GPU."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from steps import Seqs, eager

from kiln import Engine
from kiln.core.ops.attention import AttentionBatch, SeqSpan
from kiln.passes.capture_plan import logits_tail
from kiln.runtime.artefact import Artefact
from kiln.runtime.capture import GraphDecode, PiecewisePrefill, eager_recorder, unowned
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampler import as_tensor

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def runner(artefact) -> ModelRunner:
    return ModelRunner(Artefact.open(artefact("llama", compile_args={"page_size": 4})), 1024)


def test_padding_to_a_bucket_changes_nothing_but_the_scratch_page(runner) -> None:
    seqs = Seqs(runner, [[1, 5, 9], list(range(3, 20)), [7, 8], [4] * 9, [2, 6, 1]])
    seqs.prefill()
    page = runner.pool.page_size
    for which, bucket in (([0, 2, 4], 4), ([0, 1, 2, 3, 4], 8), ([3], 2)):
        step = seqs.step(which)
        want = eager(runner, step)
        k_before = runner.kv.k.clone()
        got = eager(runner, step, bucket)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.shape[0] == len(which)
        # Only the scratch page (the last one, outside the pool) saw the dummy rows.
        scratch = runner.step.pad_page * page
        assert torch.equal(runner.kv.k[:, :, :scratch], k_before[:, :, :scratch])
        assert scratch == runner.pool.num_pages * page
        seqs.advance(step, which)
    with pytest.raises(ValueError, match="has no bucket 2"):
        runner.step.plan(seqs.step([0, 1, 2]), 2)


def test_mixed_chunk_matches_per_sequence_spans(runner) -> None:
    """A prefill chunk (with a cached prefix) beside decoding sequences: the buffers' page
    table and slots give what the per-sequence reference layout gives."""
    seqs = Seqs(runner, [[1, 5, 9, 2, 2], [3, 4], [8, 8, 8]])
    seqs.prefill()
    step = seqs.step([0, 1, 2], {1: [9, 10, 11, 12, 13]})
    ctx, ids, positions, rows = runner.step.plan(step)
    assert not ctx.decode and ctx.single_seqs == [0, 2]
    got = runner.executor(ctx, ids, positions, rows)
    spans, start, at = [], 0, 0
    for q, kv, count in zip(step.q_lens, step.kv_lens, step.page_counts, strict=True):
        pages = step.pages[at : at + count]
        spans.append(SeqSpan(start, q, kv, runner.pool.slots(pages, kv), torch.tensor(pages)))
        start, at = start + q, at + count
    ref = AttentionBatch.build(runner.kv.k, runner.kv.v, spans, runner.pool.page_size)
    want = runner.executor(
        ref, torch.tensor(step.ids), torch.tensor(step.positions), torch.tensor(step.rows)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_recorded_decode_replays_over_fixed_buffers(runner) -> None:
    """The CUDA-graph runner's whole path but the capture: each bucket's step recorded once
    over buffers that never move, then replayed on new inputs at other lengths. The
    recorded page table is 32 pages a row, the sequences hold 16: a step sends only the
    columns it fills."""
    plan = {"decode": {"mode": "cuda_graph", "batch_sizes": [1, 2, 4, 8]}, "split_at": []}
    graphs = GraphDecode(runner.executor, runner.step, plan, 32, eager_recorder)
    graphs.warm_up(runner.step)
    buffers = runner.step.fixed.data_ptr()
    seqs = Seqs(runner, [[1, 2, 3], list(range(5, 16)), [4], [9, 9, 9, 9], [6, 1], [3, 3]])
    seqs.prefill()
    for which in ([0], [0, 1, 2], [0, 1, 2, 3, 4], [5, 1], [0, 1, 2, 3, 4, 5]):
        step = seqs.step(which)
        want = eager(runner, step)
        bucket = graphs.bucket(step)
        assert bucket == next(b for b in (1, 2, 4, 8) if b >= len(which))
        torch.testing.assert_close(
            graphs.run(runner.step, step, bucket)[: len(which)], want, rtol=1e-5, atol=1e-5
        )
        seqs.advance(step, which)
        # An eager step (not advanced: its K/V lie past the lengths) grows its own arena.
        runner.run(seqs.step([0], {0: list(range(40))}))
    assert runner.step.fixed.data_ptr() == buffers
    # Steps a recording cannot hold, or that are not plain decode, run eagerly.
    assert graphs.bucket(seqs.step(list(range(6)), {0: [1, 2]})) is None


def test_compiled_decode_matches_eager_and_reuses_its_cache(artefact, fresh_cache: Path) -> None:
    compiled = artefact(
        "llama", compile_args={"enable_torch_compile": True, "torch_compile_max_bs": 2}
    )
    plan = Artefact.open(compiled).graph.plan
    assert plan["decode"] == {"mode": "compiled", "batch_sizes": [1, 2], "padding": True}
    engine = Engine(compiled, max_total_tokens=1024)
    assert sorted(engine.runner.decode.sizes) == [1, 2]
    reference = Engine(artefact("llama"), max_total_tokens=1024)
    # Batches of 1 and 2 run compiled; 3 is past --torch-compile-max-bs and runs eagerly.
    for prompts in ([[1, 5, 9]], [[1, 5, 9], [4, 4, 2, 7]], [[3], [8, 1], [5, 5, 5]]):
        got = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        want = reference.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    cache = fresh_cache / "inductor"
    files = sorted(p for p in cache.rglob("*") if p.is_file())
    assert files
    Engine(compiled, max_total_tokens=1024)  # a second start compiles nothing new
    assert sorted(p for p in cache.rglob("*") if p.is_file()) == files


class SharedPool:
    """A recorder whose weak outputs all share one memory area per dtype: each replay's
    outputs overwrite the previous replay's, the worst a CUDA pool that hands freed memory
    to the next recording can do."""

    def __init__(self) -> None:
        self.area: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, fn: Callable[[], Any], weak: bool = False) -> Callable[[], Any]:
        if not weak:
            return fn

        def replay() -> tuple[Any, ...]:
            at = dict.fromkeys(self.area, 0)

            def place(o: torch.Tensor) -> torch.Tensor:
                start = at.get(o.dtype, 0)
                area = self.area.get(o.dtype)
                if area is None or area.numel() < start + o.numel():
                    area = self.area[o.dtype] = torch.empty(4 * (start + o.numel()), dtype=o.dtype)
                at[o.dtype] = start + o.numel()
                return area[start : start + o.numel()].view(o.shape).copy_(o)

            return tuple(tuple(map(place, o)) if isinstance(o, tuple) else place(o) for o in fn())

        return replay


@pytest.mark.parametrize(("family", "per_bucket"), [("llama", 3), ("mixtral", 5)])
def test_piecewise_prefill_matches_eager_on_real_rows_only(
    artefact, family: str, per_bucket: int
) -> None:
    """Prefill, extend and mixed steps at odd token counts, run padded to the plan's token
    buckets: the logits and every real KV page are the eager executor's; recordings whose
    outputs share memory do not clobber a value read later (rope's cos/sin, read by every
    layer's attention). A MoE model's MoEs run between the pieces on the real rows, as its
    attentions do (the plan cuts there: a CUDA graph cannot record their expert loop)."""
    art = Artefact.open(artefact(family, compile_args={"page_size": 4}))
    runner = ModelRunner(art, 1024)
    graph = art.graph
    plan = {
        "prefill": {"mode": "piecewise", "tokens": [8, 16, 32], "eager_from": logits_tail(graph)},
        "split_at": [n.name for n in graph.nodes if n.op in ("rope_attention", "moe")],
    }
    pieces = PiecewisePrefill(graph, art.weights, art.lib, plan, SharedPool())
    runner.prefill = pieces
    runner.warm_up()
    # Three pieces a bucket (embedding to layer 0's qkv, layer 0's o_proj to layer 1's qkv,
    # layer 1's o_proj to the last residual add), two more where each layer's MoE cuts its
    # piece; the logits tail runs eagerly.
    assert pieces.recordings == per_bucket * 3
    seqs = Seqs(runner, [list(range(3, 29)), [7, 8, 9], [4] * 5])
    pool_end = runner.step.pad_page * runner.pool.page_size
    steps = [
        ([0], {0: list(range(3, 14))}),  # an 11-token prefill: bucket 16
        ([1, 2], {1: [7, 8, 9], 2: [4] * 5}),  # two prompts, 8 tokens: no padding
        ([0, 1, 2], {0: list(range(14, 29))}),  # extend 15 beside two decodes: 17 -> 32
        ([1], {1: [5, 6]}),  # 2 tokens after 17: stale rows below them
        ([0, 1, 2], {2: list(range(3, 40))}),  # 39 tokens: past the buckets, eager
    ]
    for which, new in steps:
        step = seqs.step(which, new)
        k0, v0 = runner.kv.k.clone(), runner.kv.v.clone()
        want = eager(runner, step)
        k_want, v_want = runner.kv.k.clone(), runner.kv.v.clone()
        runner.kv.k.copy_(k0)
        runner.kv.v.copy_(v0)
        expect = None if len(step.ids) > 32 else min(b for b in (8, 16, 32) if b >= len(step.ids))
        assert pieces.bucket(step) == expect
        got = as_tensor(runner.run(step))  # the native step's are numpy
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.kv.k[:, :, :pool_end], k_want[:, :, :pool_end])
        torch.testing.assert_close(runner.kv.v[:, :, :pool_end], v_want[:, :, :pool_end])
        seqs.advance(step, which)
    assert pieces.recordings == per_bucket * 3  # nothing recorded while serving


def test_an_unowned_view_sees_the_memory_without_keeping_it() -> None:
    t = torch.arange(24, dtype=torch.float32).view(4, 6)[:, 1:4]
    alias = unowned(t)
    assert alias.shape == t.shape and alias.stride() == t.stride()
    assert alias.data_ptr() == t.data_ptr()
    t.mul_(2)
    assert torch.equal(alias, t)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None
