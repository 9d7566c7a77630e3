"""KV memory: a page allocator and the per-layer K/V tensors it indexes.

On CPU the K/V tensors live in an anonymous memory mapping: zero-filled, and committed by
the OS page by page as they are first written, so a server sized for its worst case idles
at the memory it actually used (the allocator hands out low pages first, which keeps the
touched part compact). Pages that fall free are given back to the OS (`KVCache.release`,
MADV_DONTNEED: they read as zeros again) when the engine goes idle or the prefix cache is
flushed. On GPUs the pool is allocated up front, as SGLang does.

A host pool is numpy arrays over the mapping (`k_host`, `v_host`: what the native step
binds, no torch needed); `k` and `v`, the torch tensors the Python executor and its
kernels take, are views of the same memory, made when first read.
"""

from __future__ import annotations

import math
import mmap
import time
from typing import TYPE_CHECKING

import numpy as np

from kiln.core.lazy import lazy_module
from kiln.runtime.weights import DTYPES, dtype_name, torch_view

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


class PagePool:
    """Fixed-size pages of `page_size` token slots; plain verbs, no model knowledge."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.page_size = page_size
        self.num_pages = num_pages
        # Pop from the end: low page numbers are handed out first.
        self._free = list(range(num_pages - 1, -1, -1))
        # Freed since the last `take_freed` and still free: memory that may go back.
        self._freed: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def usage(self) -> float:
        """The share of pages in use (the kiln:token_usage gauge, SGLang's token usage)."""
        return 1 - len(self._free) / self.num_pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_allocate(self, pages: int) -> bool:
        return pages <= len(self._free)

    def allocate(self, pages: int) -> list[int]:
        if pages > len(self._free):
            raise MemoryError(f"KV pool exhausted: {pages} pages asked, {len(self._free)} free")
        taken = self._free[-pages:] if pages else []
        del self._free[len(self._free) - pages :]
        self._freed.difference_update(taken)
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        self._freed.update(pages)

    def take_freed(self) -> list[int]:
        """The pages freed since the last call that are still free, in order."""
        pages = sorted(self._freed)
        self._freed.clear()
        return pages

    def put_back_freed(self, pages: list[int]) -> None:
        """Pages from `take_freed` whose memory was not given back yet (still free)."""
        self._freed.update(pages)

    def slots(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Slot index of each of the first `num_tokens` tokens stored in `pages`."""
        p = torch.tensor(pages, dtype=torch.long)
        offsets = torch.arange(self.page_size, dtype=torch.long)
        return (p[:, None] * self.page_size + offsets[None, :]).reshape(-1)[:num_tokens]


class KVCache:
    """K and V for every layer: [layers, kv_heads, slots, head_dim] each (head-major, so a
    sequence's gathered K/V is contiguous per head)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype,
        device: str = "cpu",
        v_head_dim: int | None = None,
    ) -> None:
        self.dtype = dtype_name(dtype)
        self.device = device
        self.shape = (num_layers, num_kv_heads, num_slots, head_dim)
        v_shape = (*self.shape[:3], _v_width(head_dim, v_head_dim))
        self.v_shape = v_shape
        self.itemsize = DTYPES[self.dtype].itemsize
        self.nbytes = (math.prod(self.shape) + math.prod(v_shape)) * self.itemsize
        self.k_host: np.ndarray | None = None
        self.v_host: np.ndarray | None = None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._maps: list[mmap.mmap] = []
        # Zero-filled, not uninitialised: padded decode reads slot 0 under a mask, and
        # NaN * 0 is NaN.
        if device == "cpu":
            self.k_host, k_map = _host_zeros(self.shape, self.dtype)
            self.v_host, v_map = _host_zeros(v_shape, self.dtype)
            # v_map is None for an empty V pool (latent attention keeps all it needs in K).
            self._maps = [m for m in (k_map, v_map) if m is not None]
        else:
            self._k = torch.zeros(self.shape, dtype=getattr(torch, self.dtype), device=device)
            self._v = torch.zeros(v_shape, dtype=self._k.dtype, device=device)

    @property
    def k(self) -> torch.Tensor:
        """K of every layer, [layers, kv_heads, slots, head_dim], as a torch tensor."""
        if self._k is None:
            self._k, self._v = self._views()
        return self._k

    @property
    def v(self) -> torch.Tensor:
        if self._v is None:
            self._k, self._v = self._views()
        return self._v

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host pool's torch tensors: views of its arrays."""
        assert self.k_host is not None and self.v_host is not None
        return torch_view(self.k_host, self.dtype), torch_view(self.v_host, self.dtype)

    @staticmethod
    def bytes_per_token(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype,
        v_head_dim: int | None = None,
    ) -> int:
        v_dim = _v_width(head_dim, v_head_dim)
        return num_layers * num_kv_heads * (head_dim + v_dim) * DTYPES[dtype_name(dtype)].itemsize

    def release(
        self, pages: list[int], page_size: int, budget_s: float = math.inf
    ) -> tuple[int, list[int]]:
        """Give the OS back the memory of `pages` (free ones: nothing may read them before
        writing), in whole OS pages; they read as zeros again. One madvise per run of
        pages per layer and head, so a fragmented pool costs many calls: after `budget_s`
        seconds the rest is returned, for a later call. Returns (bytes released, pages not
        handled); a GPU pool stays allocated (0 bytes)."""
        if not self._maps or not pages:
            return 0, []
        layers, heads, slots, dim = self.shape
        row = dim * self.itemsize  # bytes of one slot of one head
        deadline = time.perf_counter() + budget_s
        released = 0
        for first, count in _runs(pages):
            if time.perf_counter() > deadline:
                return released, [p for p in pages if p >= first]
            if count * page_size * row < mmap.PAGESIZE:
                continue  # no whole OS page inside (fragments cost nothing to skip)
            for block in range(layers * heads):
                start = (block * slots + first * page_size) * row
                end = start + count * page_size * row
                start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
                end = end // mmap.PAGESIZE * mmap.PAGESIZE
                if end > start:
                    for memory in self._maps:
                        memory.madvise(mmap.MADV_DONTNEED, start, end - start)
                    released += len(self._maps) * (end - start)
        return released, []


def _v_width(head_dim: int, v_head_dim: int | None) -> int:
    """The V pool's width: K's unless given (latent attention: 0, all it needs is in K)."""
    return head_dim if v_head_dim is None else v_head_dim


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first, count) runs of consecutive pages."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def _host_zeros(shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray, mmap.mmap | None]:
    storage = DTYPES[dtype].storage
    if 0 in shape:
        return np.zeros(shape, storage), None
    count = math.prod(shape)
    memory = mmap.mmap(
        -1, count * DTYPES[dtype].itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    return np.frombuffer(memory, storage, count).reshape(shape), memory
