"""KV memory: a page allocator and the per-layer K/V tensors it indexes."""

from __future__ import annotations

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
        # zeros, not empty: padded decode reads slot 0 under a mask, and NaN * 0 is NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
