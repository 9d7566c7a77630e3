"""kiln_cpu builds for the tests: one per x86-64 level this CPU can run."""

from __future__ import annotations

import ctypes
import functools
import platform

from kiln.core.target import CPU_ORDER, cpu_target, host_cpu_level
from kiln.kernels import native

# Every level up to this host's (the baseline alone off x86).
HOST_LEVELS = (
    CPU_ORDER[: CPU_ORDER.index(host_cpu_level()) + 1]
    if platform.machine() == "x86_64"
    else ("x86-64",)
)


@functools.cache
def library(level: str) -> ctypes.CDLL:
    toolchain = native.Toolchain.find()
    assert toolchain is not None, "CI has gcc: the C kernels must build"
    return native.load(native.build(cpu_target(level), toolchain))
