"""torch, imported on first use: reading a graph (kiln inspect, kiln diff) needs the op
definitions, which hold torch reference kernels, but never runs them, and importing torch
costs 1.5-3 s on the machines kiln is built on. Modules of the bottom layer write

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_module("torch")

so types are checked as usual and the import happens at the first `torch.x` at run time."""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
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
    _open_libraries(name)
    importlib.import_module(name)
    _imported(name)


# The shared libraries a module's import opens, each a path in its package (an extension
# module by its name without a suffix) and the dlopen flags its import adds. Python's import
# holds the GIL while the dynamic loader maps a library and runs its constructors: opening
# torch's libtorch_cpu.so took 0.35-0.39 s of it on a Zen 3, and a server that takes torch
# while idle answered nothing, /health included, for that long. dlopen called as a ctypes
# foreign function lets go of the GIL; the import then finds the libraries open (the
# longest stop left while torch imports: 0.07-0.08 s).
_LIBRARIES: dict[str, tuple[tuple[str, int], ...]] = {
    "torch": (("lib/libtorch_global_deps.so", os.RTLD_GLOBAL), ("_C", 0)),
}


# Held while a library opens. The process's exit waits for it (atexit): without the GIL
# held, exit() could run the static destructors of a library whose dependants' constructors
# are still running on the import thread (a segfault, seen in 2 of 3 exits 0.1-0.2 s after
# a prefetch began); once exiting, nothing more is opened.
_OPENING = threading.Lock()
_EXITING = False


@atexit.register
def _no_more_libraries() -> None:
    global _EXITING
    with _OPENING:
        _EXITING = True


def _open_libraries(name: str) -> None:
    """Open module `name`'s shared libraries (_LIBRARIES) with the GIL released, where the
    platform has dlopen; a library that does not open is left to the import to report."""
    parts = _LIBRARIES.get(name, ())
    spec = importlib.util.find_spec(name) if parts and sys.platform == "linux" else None
    if spec is None or not spec.submodule_search_locations:
        return
    root = next(iter(spec.submodule_search_locations))
    dlopen = ctypes.CDLL(None).dlopen
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    for part, flags in parts:
        path = os.path.join(root, part)
        if not os.path.splitext(part)[1]:  # an extension module: its platform's file name
            found = [path + s for s in importlib.machinery.EXTENSION_SUFFIXES]
            path = next((p for p in found if os.path.exists(p)), path)
        with _OPENING:
            if _EXITING:
                return
            if os.path.exists(path):
                dlopen(os.fsencode(path), sys.getdlopenflags() | flags)


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
