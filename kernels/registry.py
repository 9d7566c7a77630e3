"""Kernel registry: op -> backend name -> implementation.

Each op's reference kernel (its definition's, kiln/core/ops) is its `torch_native` kernel.
Other backends register theirs with `@register(op, backend)`, and the registry holds each
to the signature the op's definition implies (`([ctx,] *inputs, *, a[, lib])`: the step
context first for ops that attend, the attribute object `a`, the native library `lib` for
kernels of the artefact's library), refusing a mismatch as the module is imported.

Backend modules register into it as they are imported; `kiln.kernels.catalog` imports them
all and is what the compiler and runtime look kernels up in. `select_backends` (a compiler
pass) records one backend per node; the runtime looks the kernel up by (op, backend) and
never branches on the device itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.core.opdef import OpDef, signature_problem
from kiln.core.ops import ELEMENTWISE, OPS, STRUCTURAL_OPS

# torch_native: the reference, every device. kiln_cpu: kiln's own C kernels for fp32 on CPU
# (linears on packed weights, paged decode attention, norms, rope). triton / flashinfer:
# GPU kernels.
BACKENDS = ("torch_native", "kiln_cpu", "triton", "flashinfer")


@dataclass(frozen=True)
class Kernel:
    op: OpDef
    backend: str
    fn: Callable[..., Any]
    devices: tuple[str, ...]
    # Kernels of the artefact's native library take it as the keyword `lib` (bound by the
    # executor; the library is opened by runtime/native.py).
    native: bool = False
    # The steps it runs, for an op that attends: "decode" (every sequence adds one token)
    # and "prefill" (every other step: prefills, extends, mixed chunks). A kernel covers
    # what it says and nothing else; select_backends records one kernel per phase.
    phases: tuple[str, ...] = ("decode", "prefill")
    # Optional attributes of the op this kernel does not compute (attention's `softcap`):
    # it is no kernel of a node that sets one (select_backends; checked again at load).
    unsupported: tuple[str, ...] = ()
    # A row's output is the same whatever other rows share the call: every row takes the
    # same arithmetic in the same order for any row count (no tile, split or library
    # algorithm chosen by the batch). --enable-deterministic-inference on a CUDA target
    # takes only such kernels (passes/select_backends.py).
    batch_invariant: bool = False
    # Slower than the op's usual kernel and chosen only for that flag (the Triton linear,
    # whose fixed tiles give up cuBLAS's per-shape choice).
    deterministic_only: bool = False

    def refuses(self, attrs: dict[str, Any]) -> str | None:
        """The attribute of `attrs` this kernel does not compute, if any."""
        return next((name for name in self.unsupported if attrs.get(name)), None)

    @property
    def needs_ctx(self) -> bool:
        """Takes the step's attention context first (the op reads the KV pool)."""
        return self.op.needs_ctx


# Reference kernels that compute each row from that row alone without a reduction a
# library tiles by the batch: elementwise ops, gathers and the rotary tables.
ROW_LOCAL = ELEMENTWISE | {"embedding", "index_select", "split", "rope_cos_sin", "rope"}

_KERNELS: dict[str, dict[str, Kernel]] = {
    name: {
        "torch_native": Kernel(
            d, "torch_native", d.reference, ("cpu", "cuda"), batch_invariant=name in ROW_LOCAL
        )
    }
    for name, d in OPS.items()
    if name not in STRUCTURAL_OPS and d.reference is not None
}


def register(
    op: str,
    backend: str,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    native: bool = False,
    phases: tuple[str, ...] = ("decode", "prefill"),
    unsupported: tuple[str, ...] = (),
    batch_invariant: bool = False,
    deterministic_only: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as `backend`'s kernel of `op` (see `Kernel` for what
    the arguments mean)."""
    if backend not in BACKENDS or backend == "torch_native":
        raise ValueError(f"unknown backend {backend!r} (torch_native is each op's reference)")
    definition = OPS.get(op)
    if definition is None or op in STRUCTURAL_OPS:
        raise ValueError(f"{backend}: no op {op!r} to register a kernel for")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        problem = signature_problem(definition, fn, native)
        if problem is not None:
            raise TypeError(f"{backend} kernel of {op} ({fn.__qualname__}) {problem}")
        _KERNELS.setdefault(op, {})[backend] = Kernel(
            definition,
            backend,
            fn,
            devices,
            native,
            phases,
            unsupported,
            batch_invariant,
            deterministic_only,
        )
        return fn

    return deco


def get(op: str, backend: str) -> Kernel:
    try:
        return _KERNELS[op][backend]
    except KeyError:
        have = ", ".join(sorted(_KERNELS.get(op, {}))) or "none"
        raise KeyError(f"no {backend!r} kernel for op {op!r} (registered: {have})") from None


def available(
    op: str,
    device: str,
    phase: str = "decode",
    attrs: dict[str, Any] | None = None,
    batch_invariant: bool = False,
) -> list[str]:
    """Backends that implement `op` on `device` for `phase` (and, given a node's `attrs`,
    compute all of them), the reference first. `batch_invariant`: only the kernels that are
    (--enable-deterministic-inference), else none that is only for that."""
    return [
        k.backend
        for k in _KERNELS.get(op, {}).values()
        if device in k.devices
        and phase in k.phases
        and not k.refuses(attrs or {})
        and (k.batch_invariant if batch_invariant else not k.deterministic_only)
    ]


def kernels() -> list[Kernel]:
    """Every registered kernel."""
    return [k for per_op in _KERNELS.values() for k in per_op.values()]
