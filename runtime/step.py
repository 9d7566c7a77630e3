"""A step's device-side inputs: preallocated buffers, filled by `StepContext.plan`.

`plan` turns a step (runtime/model_runner.py `StepInputs`: flat lists from the scheduler)
into the tensors the graph and its attention kernels read, written into buffers that live as
long as the runner on its device: token ids, positions, logits rows, the page table, each
sequence's length and the slot of every new token. The only per-sequence Python left is the
scheduler's own lists; the page table and the slots are computed by a few array ops from
the flat lists (numpy, on the host), copied to the device in one transfer, and nothing
reads a device value back.

Padding. A captured or compiled step runs at a bucket size (passes/capture_plan.py). A
decode step of n sequences padded to bucket b gets b - n dummy sequences: token 0 at
position 0, one cached token, its page the pool's scratch page (one page past those the
allocator hands out), so every attention backend runs them unchanged and they can never
touch a real sequence's K/V. Their logits rows come last and the runner drops them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.core.lazy import lazy_module
from kiln.core.ops.attention import AttentionBatch, SeqSpan

if TYPE_CHECKING:
    import torch

    from kiln.runtime.kv_cache import KVCache
else:
    torch = lazy_module("torch")


@dataclass
class StepInputs:
    """One step, flat: the new tokens of every sequence back to back."""

    ids: list[int]
    positions: list[int]
    rows: list[int]  # the rows whose logits come back
    q_lens: list[int]  # new tokens of each sequence
    kv_lens: list[int]  # cached plus new tokens of each sequence
    page_counts: list[int]  # pages of each sequence
    pages: list[int]  # every sequence's pages, back to back
    # Each sequence's LoRA adapter slot (runtime/lora.py; 0: the base model), or None when
    # no sequence has one; every tensor-parallel rank holds the same adapters in the same slots.
    adapters: list[int] | None = None
    # An EAGLE head's step: each new token's hidden state (float32 [tokens, width], numpy;
    # a head runs at tensor-parallel size 1, so it is not encoded)
    hidden: Any = None

    @property
    def decode(self) -> bool:
        """Every sequence feeds one token."""
        return len(self.ids) == len(self.q_lens)

    def encode(self) -> torch.Tensor:
        """One int64 tensor (for the other tensor-parallel ranks): counts, then the lists
        (the adapters' count 0 when there are none)."""
        adapters = self.adapters or []
        head = [len(self.ids), len(self.rows), len(self.q_lens), len(self.pages), len(adapters)]
        flat = [*head, *self.ids, *self.positions, *self.rows]
        flat += [*self.q_lens, *self.kv_lens, *self.page_counts, *self.pages, *adapters]
        return torch.tensor(flat, dtype=torch.long)

    @classmethod
    def decode_from(cls, t: torch.Tensor) -> StepInputs:
        v = t.tolist()
        n_ids, n_rows, n_seqs, n_pages, n_adapters = v[:5]
        parts = []
        at = 5
        for n in (n_ids, n_ids, n_rows, n_seqs, n_seqs, n_seqs, n_pages, n_adapters):
            parts.append(v[at : at + n])
            at += n
        ids, positions, rows, q_lens, kv_lens, counts, pages, adapters = parts
        return cls(ids, positions, rows, q_lens, kv_lens, counts, pages, adapters or None)


class StepContext:
    """The step buffers of one runner on `device`: one int64 arena that a step's inputs are
    copied into at once, laid out per step shape (ids, positions, logits rows, new-token
    slots, then per sequence its length, new tokens and first row, then the page table),
    with the views of each shape made once. It grows (never shrinks) to the largest step
    seen. Recorded steps (`fixed`) have an arena of their own, sized once by `reserve` for
    the largest bucket, so every address a recorded step reads stays put."""

    VIEW_CACHE = 256  # step shapes whose views are kept

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int) -> None:
        self._start(
            SimpleNamespace(k=k_cache, v=v_cache), k_cache.shape[2], page_size, k_cache.device
        )

    @classmethod
    def over(cls, kv: KVCache, page_size: int) -> StepContext:
        """The step buffers over an engine's KV pool, whose torch tensors (like these
        buffers) are made when a step is first planned: the native step plans only rows
        (`plan_rows`), and runs without torch."""
        ctx = cls.__new__(cls)
        ctx._start(kv, kv.shape[2], page_size, kv.device)
        return ctx

    def _start(self, pools: Any, slots: int, page_size: int, device: Any) -> None:
        self._pools = pools  # .k and .v: the pool's tensors
        self.page_size = page_size
        self.device = device
        # The scratch page: the last page of the KV tensors, which the allocator never hands
        # out (the runner sizes the cache one page past its pool).
        self.pad_page = slots // page_size - 1
        self.arena: torch.Tensor | None = None  # made by the first step planned
        self.fixed: torch.Tensor | None = None  # made by `reserve`
        self.width = 0  # the page table's width in a recorded (fixed) step
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    @property
    def k_cache(self) -> torch.Tensor:
        return self._pools.k

    @property
    def v_cache(self) -> torch.Tensor:
        return self._pools.v

    @staticmethod
    def _need(tokens: int, rows: int, seqs: int, width: int) -> int:
        return 3 * tokens + rows + 3 * seqs + seqs * width

    def reserve(self, tokens: int, seqs: int, width: int) -> None:
        """The recorded steps' arena: `tokens` new tokens over `seqs` sequences, each
        page table row `width` pages. Once only: recordings hold its addresses."""
        if self.fixed is not None:
            raise RuntimeError("the recorded steps' buffers are already reserved")
        self.width = width
        self.fixed = self._buffer(self._need(tokens, tokens, seqs, width))

    def _grow(self, need: int) -> None:
        if self.arena is None or need > self.arena.numel():
            self.arena = self._buffer(need)
            self._views = {k: v for k, v in self._views.items() if k[-1]}

    def _buffer(self, size: int) -> torch.Tensor:
        # A normal tensor even when made inside inference mode (a warm-up): an inference
        # tensor could not be written by the steps that run outside it.
        with torch.inference_mode(False):
            return torch.zeros(size, dtype=torch.long, device=self.device)

    def _layout(self, key: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """(ids, positions, rows, slots, kv_lens, q_lens, q_starts, table, kv_index) of a
        step of this (tokens, rows, seqs, width, fixed)."""
        views = self._views.get(key)
        if views is None:
            tokens, rows, seqs, width, fixed = key
            arena = self.fixed if fixed else self.arena
            assert arena is not None
            parts, at = [], 0
            for size in (tokens, tokens, rows, tokens, seqs, seqs, seqs, seqs * width):
                parts.append(arena[at : at + size])
                at += size
            table = parts[-1].view(seqs, width)
            views = (*parts[:-1], table, parts[-1])
            if len(self._views) >= self.VIEW_CACHE:
                self._views = {k: v for k, v in self._views.items() if k[-1]}
            self._views[key] = views
        return views

    def plan(
        self, step: StepInputs, bucket: int | None = None, fixed: bool = False
    ) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's attention batch and its graph inputs (ids, positions, logits rows),
        padded to `bucket` sequences when given (decode steps only). `fixed`: a recorded
        step's form, whose every tensor is a view of the arena at an offset that depends on
        the bucket alone (the page table at its reserved width, any mask built from the
        lengths on the device)."""
        n, seqs = len(step.ids), len(step.q_lens)
        pad = 0
        if bucket is not None:
            if not step.decode or bucket < n:
                raise ValueError(
                    f"a step of {n} tokens over {seqs} sequences has no bucket {bucket}"
                )
            pad = bucket - n
        total, nseq = n + pad, seqs + pad
        nrows = len(step.rows) + pad
        used = width = max(step.page_counts) if step.page_counts else 1
        if fixed:
            need = self._need(total, nrows, nseq, self.width)
            if self.fixed is None or width > self.width or need > len(self.fixed):
                raise ValueError(
                    f"a step of {total} sequences of up to {width} pages does not fit the "
                    f"recorded buffers ({self.width} pages a sequence)"
                )
            width = self.width
        else:
            self._grow(self._need(total, nrows, nseq, width))

        # Host side, vectorised in numpy (a microsecond or two an op, where a torch op on
        # small tensors costs ~5): the page table and every new token's slot; then one
        # transfer into the arena (two for a recorded step, below).
        ids = np.array(step.ids + [0] * pad, dtype=np.int64)
        pos = np.array(step.positions + [0] * pad, dtype=np.int64)
        rows = np.array(step.rows + list(range(n, total)) if pad else step.rows, dtype=np.int64)
        q = np.array(step.q_lens + [1] * pad, dtype=np.int64)
        kv = np.array(step.kv_lens + [1] * pad, dtype=np.int64)
        table = page_table(step.page_counts + [1] * pad, step.pages + [self.pad_page] * pad, used)
        size = self.page_size
        slots = table[np.repeat(np.arange(nseq), q), pos // size] * size + pos % size
        head = (ids, pos, rows, slots, kv, q, np.cumsum(q) - q)
        arena = self.fixed if fixed else self.arena
        assert arena is not None
        d_ids, d_pos, d_rows, d_slots, d_kv, d_q, d_starts, d_table, d_index = self._layout(
            (total, nrows, nseq, width, fixed)
        )
        if used == width:
            host = np.concatenate((*head, table.ravel()))
            arena[: len(host)].copy_(torch.from_numpy(host), non_blocking=True)
        else:
            # A recorded step's table rows are `self.width` pages wide (up to the context's
            # pages), but no kernel uses an entry past a sequence's pages: only the columns
            # this step fills are sent, not [sequences, context pages] every step. The
            # columns past them keep page numbers earlier steps wrote (zeros at first), in
            # the pool's range, read under the length mask at most.
            host = np.concatenate(head)
            arena[: len(host)].copy_(torch.from_numpy(host), non_blocking=True)
            d_table[:, :used].copy_(torch.from_numpy(table), non_blocking=True)

        batch = AttentionBatch(self.k_cache, self.v_cache, d_slots, [], page_size=size)
        batch.num_seqs = nseq
        batch.page_table = d_table
        batch.q_starts, batch.q_lens, batch.seq_kv_lens = d_starts, d_q, d_kv
        batch.max_q_len = max(step.q_lens + [1] * bool(pad))
        if step.decode:
            batch.decode = True
            batch.kv_index = d_index  # [seqs * width] page ids
            batch.kv_lens = d_kv
            batch.kv_width = width * size
            batch.max_kv_len = 0 if fixed else max(step.kv_lens + [1] * bool(pad))
        else:
            batch.seqs = self._spans(step, d_table)
            batch.plan_singles()
        return batch, d_ids, d_pos, d_rows

    def plan_rows(self, step: StepInputs) -> tuple[array[int], int]:
        """Any step as the native step reads it (runtime/native_step.py): every new token a
        row attending to its sequence's keys up to and including its own, through its
        sequence's page table. One int64 buffer of ids, positions, logits rows, each row's
        KV slot, KV length and page table (by sequence), then the tables [seqs, width]; and
        the tables' width. Host memory only (the native step is a CPU step).

        Plain Python into an `array`, not numpy: a batch-1 decode step's buffer took 91 us
        through a dozen numpy calls against 16 here (a 2-core Zen 3), and more right after
        a step, whose weights stream has evicted numpy's code and data from the caches."""
        width = max(step.page_counts) if step.page_counts else 1
        size = self.page_size
        slots: list[int] = []
        kv: list[int] = []
        row_seq: list[int] = []
        table = array("q")
        at = 0
        for s, (q, total, count) in enumerate(
            zip(step.q_lens, step.kv_lens, step.page_counts, strict=True)
        ):
            pages = step.pages[at : at + count]
            at += count
            # A row's KV length: its sequence's cached tokens, then the new ones through
            # its own; its K/V go to the slot of its last key.
            for k in range(total - q, total):
                slots.append(pages[k // size] * size + k % size)
            kv += range(total - q + 1, total + 1)
            row_seq += [s] * q
            table += array("q", pages)
            if count < width:
                table += array("q", bytes(8 * (width - count)))
        buf = array("q", step.ids)
        for part in (step.positions, step.rows, slots, kv, row_seq):
            buf += array("q", part)
        buf += table
        return buf, width

    def _spans(self, step: StepInputs, table: torch.Tensor) -> list[SeqSpan]:
        """Per-sequence spans of a prefill or mixed step (its attention runs per sequence)."""
        size = self.page_size
        slots = (table[:, :, None] * size + torch.arange(size, device=self.device)).flatten(1)
        spans, start = [], 0
        for i, (q, kv, count) in enumerate(
            zip(step.q_lens, step.kv_lens, step.page_counts, strict=True)
        ):
            spans.append(SeqSpan(start, q, kv, slots[i, :kv], table[i, :count]))
            start += q
        return spans


def page_table(counts: list[int], pages: list[int], width: int) -> np.ndarray:
    """Sequences' pages (back to back, `counts` each) as a table [sequences, width],
    zero-padded."""
    count = np.array(counts, dtype=np.int64)
    owner = np.repeat(np.arange(len(count)), count)
    column = np.arange(len(pages)) - (np.cumsum(count) - count)[owner]
    table = np.zeros((len(count), width), dtype=np.int64)
    table[owner, column] = np.array(pages, dtype=np.int64)
    return table
