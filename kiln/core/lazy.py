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
import threading
from collections.abc import Callable
from typing import Any


class _LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        _imported(self._name)
        value = getattr(module, attr)
        setattr(self, attr, value)  # later reads are plain attribute hits
        return value


# Every stand-in, with the namespace of the module that holds it.
_STAND_INS: list[tuple[dict[str, Any], _LazyModule]] = []
# What to do with a module once it is imported (`on_import`), by name.
_HOOKS: dict[str, list[Callable[[Any], None]]] = {}


def on_import(name: str, fn: Callable[[Any], None]) -> None:
    """Call `fn(module)` once module `name` is imported: now if it is, else when a
    stand-in or `resolve` first imports it (the runtime's thread count reaches torch so,
    however late torch comes: runtime/threads.py)."""
    if name in sys.modules:
        fn(sys.modules[name])
    else:
        _HOOKS.setdefault(name, []).append(fn)


def prefetch(name: str) -> None:
    """Import module `name` on a background thread, once, unless it is imported already:
    a server that started without torch takes it while idle, so that the first request
    that needs it (sampling, a step of the Python executor) does not wait for it."""
    if name in sys.modules or name in _PREFETCHING:
        return
    _PREFETCHING.add(name)
    threading.Thread(target=_load, args=(name,), name=f"kiln-import-{name}", daemon=True).start()


_PREFETCHING: set[str] = set()


def _load(name: str) -> None:
    importlib.import_module(name)
    _imported(name)


def _imported(name: str) -> None:
    for fn in _HOOKS.pop(name, []):
        fn(sys.modules[name])


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
        _imported(proxy._name)
        for key, value in list(namespace.items()):
            if value is proxy:
                namespace[key] = real
