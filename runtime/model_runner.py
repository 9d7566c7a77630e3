"""The model runner owns device state (weights, KV cache) and runs one batch per call.

A step is flattened into `StepInputs` (token ids, positions, logits rows, and each
sequence's span and pages) so that a tensor-parallel rank 0 can send it to the other ranks
(runtime/parallel.py), which run the same step on their own weights and KV heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels.attention import AttentionBatch, SeqSpan
from kiln.runtime.artefact import Artefact
from kiln.runtime.executor import Executor
from kiln.runtime.kv_cache import KVCache, PagePool
from kiln.runtime.scheduler import Batch


@dataclass
class StepInputs:
    ids: list[int]
    positions: list[int]
    rows: list[int]  # the rows whose logits come back
    seqs: list[tuple[int, int, int, list[int]]]  # (q_start, q_len, kv_len, pages)

    def encode(self) -> torch.Tensor:
        """One int64 tensor: counts, then the lists, then each sequence."""
        head = [len(self.ids), len(self.rows), len(self.seqs)]
        flat = [*head, *self.ids, *self.positions, *self.rows]
        for start, n, kv_len, pages in self.seqs:
            flat += [start, n, kv_len, len(pages), *pages]
        return torch.tensor(flat, dtype=torch.long)

    @classmethod
    def decode(cls, t: torch.Tensor) -> StepInputs:
        v = t.tolist()
        n_ids, n_rows, n_seqs = v[:3]
        at = 3
        ids, at = v[at : at + n_ids], at + n_ids
        positions, at = v[at : at + n_ids], at + n_ids
        rows, at = v[at : at + n_rows], at + n_rows
        seqs = []
        for _ in range(n_seqs):
            start, n, kv_len, n_pages = v[at : at + 4]
            seqs.append((start, n, kv_len, v[at + 4 : at + 4 + n_pages]))
            at += 4 + n_pages
        return cls(ids, positions, rows, seqs)


class ModelRunner:
    def __init__(self, art: Artefact, max_total_tokens: int) -> None:
        spec = art.spec
        self.spec = spec
        self.device = art.manifest["target"]["device"]
        self.executor = Executor(art.graph, art.weights, art.lib)
        self.pool = PagePool(max(1, max_total_tokens // spec.page_size), spec.page_size)
        self.kv = KVCache(
            spec.num_layers,
            self.pool.num_pages * spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.kv_torch_dtype,
            self.device,
        )
        self.group = None  # rank 0 of a tensor-parallel artefact: its TPGroup

    def forward(self, batch: Batch, all_logits: bool = False) -> torch.Tensor:
        """Logits of the last fed token of each request that samples this step
        ([sampling requests, vocab]), or of every fed token when `all_logits`."""
        step = self.inputs(batch, all_logits)
        if self.group is not None:
            self.group.send(step)
        return self.run(step)

    @staticmethod
    def inputs(batch: Batch, all_logits: bool = False) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        seqs = []
        for req, fed, sampled in zip(batch.requests, batch.new_tokens, batch.sample, strict=True):
            start, kv_len = len(ids), req.kv_len + len(fed)
            ids += fed
            positions += range(req.kv_len, kv_len)
            if sampled:
                last.append(len(ids) - 1)
            seqs.append((start, len(fed), kv_len, list(req.pages)))
        return StepInputs(ids, positions, list(range(len(ids))) if all_logits else last, seqs)

    def run(self, step: StepInputs) -> torch.Tensor:
        seqs = [
            SeqSpan(
                start,
                n,
                kv_len,
                self.pool.slots(pages, kv_len),
                torch.tensor(pages, dtype=torch.long),
            )
            for start, n, kv_len, pages in step.seqs
        ]
        dev = self.device
        ctx = AttentionBatch.build(self.kv.k, self.kv.v, seqs, self.pool.page_size)
        return self.executor(
            ctx,
            torch.tensor(step.ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            torch.tensor(step.rows, dtype=torch.long, device=dev),
        )
