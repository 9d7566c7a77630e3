"""Weights repacked into a kernel's own layout: made on first use, kept while the weight
lives. Serving pays one packed copy per weight; a weight a kernel never sees costs
nothing."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class PackedWeights:
    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._make = make
        self._by_id: dict[int, torch.Tensor] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        packed = self._by_id.get(key)
        if packed is None:
            packed = self._make(weight)
            self._by_id[key] = packed
            weakref.finalize(weight, self._by_id.pop, key, None)  # ids are reused after free
        return packed
