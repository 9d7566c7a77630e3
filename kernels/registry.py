"""Kernel registry: op name -> backend name -> implementation.

Backend modules register into it as they are imported; `kiln.kernels.catalog` imports them
all and is what the compiler and runtime look kernels up in. `select_backends` (a compiler
pass) records one backend per node; the runtime looks the kernel up by (op, backend) and
never branches on the device itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# torch_native: reference, every device. kiln_cpu: kiln's own C kernels for fp32 on CPU
# (linears on packed weights, paged decode attention, norms, rope). triton / flashinfer:
# GPU kernels.
BACKENDS = ("torch_native", "kiln_cpu", "triton", "flashinfer")


@dataclass(frozen=True)
class Kernel:
    op: str
    backend: str
    fn: Callable[..., Any]
    devices: tuple[str, ...]
    # Kernels that read per-step runtime state (the KV cache, sequence layout) take the
    # step's context as their first argument.
    needs_ctx: bool = False
    # Kernels of the artefact's native library take it as the keyword `lib` (bound by the
    # executor; the library is opened by runtime/native.py).
    native: bool = False


_KERNELS: dict[str, dict[str, Kernel]] = {}


def register(
    op: str,
    backend: str = "torch_native",
    devices: tuple[str, ...] = ("cpu", "cuda"),
    needs_ctx: bool = False,
    native: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _KERNELS.setdefault(op, {})[backend] = Kernel(op, backend, fn, devices, needs_ctx, native)
        return fn

    return deco


def get(op: str, backend: str) -> Kernel:
    try:
        return _KERNELS[op][backend]
    except KeyError:
        have = ", ".join(sorted(_KERNELS.get(op, {}))) or "none"
        raise KeyError(f"no {backend!r} kernel for op {op!r} (registered: {have})") from None


def available(op: str, device: str) -> list[str]:
    """Backends that implement `op` on `device`, in registration order."""
    return [k.backend for k in _KERNELS.get(op, {}).values() if device in k.devices]


def ops_with_kernels() -> set[str]:
    return set(_KERNELS)
