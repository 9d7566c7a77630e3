"""The model runner owns device state (weights, KV cache) and runs one batch per call."""

from __future__ import annotations

import torch

from kiln.kernels.attention import AttentionBatch, SeqSpan
from kiln.runtime.artefact import Artefact
from kiln.runtime.executor import Executor
from kiln.runtime.kv_cache import KVCache, PagePool
from kiln.runtime.scheduler import Batch


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

    def forward(self, batch: Batch, all_logits: bool = False) -> torch.Tensor:
        """Logits of the last fed token of each request that samples this step
        ([sampling requests, vocab]), or of every fed token when `all_logits`."""
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        seqs: list[SeqSpan] = []
        for req, fed, sampled in zip(batch.requests, batch.new_tokens, batch.sample, strict=True):
            start, kv_len = len(ids), req.kv_len + len(fed)
            ids += fed
            positions += range(req.kv_len, kv_len)
            if sampled:
                last.append(len(ids) - 1)
            pages = torch.tensor(req.pages, dtype=torch.long)
            seqs.append(SeqSpan(start, len(fed), kv_len, self.pool.slots(req.pages, kv_len), pages))
        dev = self.device
        ctx = AttentionBatch.build(self.kv.k, self.kv.v, seqs, self.pool.page_size)
        rows = range(len(ids)) if all_logits else last
        return self.executor(
            ctx,
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(list(rows), dtype=torch.long, device=dev),
        )
