"""KV memory: a page allocator and the per-layer K/V tensors it indexes.

On CPU the K/V tensors live in an anonymous memory mapping: zero-filled, and committed by
the OS page by page as they are first written, so a server sized for its worst case idles
at the memory it actually used (the allocator hands out low pages first, which keeps the
touched part compact). On GPUs the pool is allocated up front, as SGLang does.
"""

from __future__ import annotations

import mmap

import torch


class PagePool:
    """Fixed-size pages of `page_size` token slots; plain verbs, no model knowledge."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.page_size = page_size
        self.num_pages = num_pages
        # Pop from the end: low page numbers are handed out first.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_allocate(self, pages: int) -> bool:
        return pages <= len(self._free)

    def allocate(self, pages: int) -> list[int]:
        if pages > len(self._free):
            raise MemoryError(f"KV pool exhausted: {pages} pages asked, {len(self._free)} free")
        taken = self._free[-pages:] if pages else []
        del self._free[len(self._free) - pages :]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

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
        dtype: torch.dtype,
        device: str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, num_slots, head_dim)
        # Zero-filled, not uninitialised: padded decode reads slot 0 under a mask, and
        # NaN * 0 is NaN.
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.nbytes = 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = max(numel * dtype.itemsize, 1)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)
