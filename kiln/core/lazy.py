"""torch, imported on first use: reading a graph (kiln inspect, kiln diff) needs the op
definitions, which hold torch reference kernels, but never runs them, and importing torch
costs 1.5-3 s on the machines kiln is built on. Modules of the bottom layer write

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_module("torch")

so types are checked as usual and the import happens at the first `torch.x` at run time."""

from __future__ import annotations

import importlib
from typing import Any


class _LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads are plain attribute hits
        return value


def lazy_module(name: str) -> Any:
    """A stand-in for module `name` that imports it when an attribute is first read."""
    return _LazyModule(name)
