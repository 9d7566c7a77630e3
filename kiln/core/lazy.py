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
import sys
from typing import Any


class _LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads are plain attribute hits
        return value


# Every stand-in, with the namespace of the module that holds it.
_STAND_INS: list[tuple[dict[str, Any], _LazyModule]] = []


def lazy_module(name: str) -> Any:
    """A stand-in for module `name` that imports it when an attribute is first read."""
    proxy = _LazyModule(name)
    _STAND_INS.append((sys._getframe(1).f_globals, proxy))
    return proxy


def resolve() -> None:
    """Put the real modules in place of every stand-in. What runs kernels calls this
    first (kiln/kernels/registry.py): torch.compile must see torch itself in a reference
    kernel's globals, not an object whose attributes appear as they are first read (the
    first trace and a later one would differ, and Inductor's cache would miss)."""
    for namespace, proxy in _STAND_INS:
        real = importlib.import_module(proxy._name)
        for key, value in list(namespace.items()):
            if value is proxy:
                namespace[key] = real
