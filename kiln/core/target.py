"""The compile target: the device and the instruction set an artefact is built for.

A target is a compile input like any other (in the manifest and the cache key). By default
it is this host, at the highest level it supports; it can be named, so a CI machine builds
for another fleet. CPU targets are x86-64 levels, so an artefact runs on any machine of its
level, not only on the one that built it:

  x86-64   the baseline (SSE2)
  avx2     x86-64-v3: AVX2, FMA, F16C (Haswell, Zen and later)
  avx512   x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Zen 4 and later)
  avx512_vnni  x86-64-v4 with AVX-512 VNNI int8 dot products (Cascade Lake, Zen 4, later)

CUDA targets are compute capabilities (`sm_90`). Hosts are read from /proc/cpuinfo and
nvidia-smi (torch only when it is already loaded), so naming or checking a target never
imports torch.
"""

from __future__ import annotations

import functools
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# Level -> (CPU flags it requires, as /proc/cpuinfo names them; gcc -march).
CPU_LEVELS: dict[str, tuple[tuple[str, ...], str]] = {
    "x86-64": ((), "x86-64"),
    "avx2": (_V3, "x86-64-v3"),
    "avx512": (_V4, "x86-64-v4"),
    "avx512_vnni": ((*_V4, "avx512_vnni"), "x86-64-v4"),
}
CPU_ORDER = ("x86-64", "avx2", "avx512", "avx512_vnni")
# gcc flags a level adds to its -march.
CPU_EXTRA_CFLAGS: dict[str, tuple[str, ...]] = {"avx512_vnni": ("-mavx512vnni",)}
# Features a CPU target may carry beyond its level, for kernels that use them.
EXTRA_FEATURES = ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
CUDA_ARCH = re.compile(r"sm_(\d)(\d+)")


class TargetError(ValueError):
    """A target that cannot be named or cannot run here; the message names the flag."""


@dataclass(frozen=True)
class Target:
    device: str  # cpu | cuda
    isa: str  # a CPU level (x86-64, avx2, avx512) or a CUDA arch (sm_90)
    features: tuple[str, ...] = ()  # CPU flags the artefact's code requires

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "isa": self.isa, "features": list(self.features)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Target:
        return cls(d["device"], d["isa"], tuple(d.get("features", ())))

    @property
    def march(self) -> str:
        """gcc's -march for a CPU target."""
        return CPU_LEVELS[self.isa][1]

    @property
    def vector_lanes(self) -> int:
        """fp32 lanes of one vector register on this target (kiln_cpu's packing width)."""
        return 16 if self.isa.startswith("avx512") else 8

    def __str__(self) -> str:
        return f"{self.device}/{self.isa}"


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_cpu_level() -> str:
    """The highest level this CPU supports (x86-64 on other architectures, whose C
    kernels build without -march)."""
    flags = host_cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return "x86-64"
    best = "x86-64"
    for level in CPU_ORDER:
        if set(CPU_LEVELS[level][0]) <= flags:
            best = level
    return best


def cpu_target(isa: str | None) -> Target:
    """The CPU target `--target-isa` names (native or unset: this host's level)."""
    level = host_cpu_level() if isa in (None, "native") else isa
    if level not in CPU_LEVELS:
        raise TargetError(
            f"--target-isa {isa}: not a CPU level (choose native, {', '.join(CPU_ORDER)})"
        )
    return Target("cpu", level, tuple(sorted(CPU_LEVELS[level][0])))


def cuda_target(isa: str | None) -> Target:
    """The CUDA target `--target-isa` names (native or unset: this host's first GPU)."""
    if isa in (None, "native"):
        capability = _host_cuda_capability()
        if capability is None:
            raise TargetError(
                "--device cuda: no GPU here to read the target from; name it with "
                "--target-isa sm_XX (sm_80 A100, sm_89 L4, sm_90 H100)"
            )
        return Target("cuda", f"sm_{capability[0]}{capability[1]}")
    if not CUDA_ARCH.fullmatch(isa):
        raise TargetError(f"--target-isa {isa}: not a CUDA arch (for example sm_90)")
    return Target("cuda", isa)


@functools.cache
def _host_cuda_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability: from torch when it is loaded, else from
    nvidia-smi (no torch import), else None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return int(major), int(minor)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
        major, minor = out[0].split(".")
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def host_device() -> str:
    """cuda when this host has an NVIDIA GPU, else cpu (SGLang's default device)."""
    return "cuda" if _host_cuda_capability() is not None else "cpu"


def resolve(device: str | None, isa: str | None) -> Target:
    """The target of `--device` / `--target-isa` (defaults: this host)."""
    if device is None:
        device = "cuda" if isa and CUDA_ARCH.fullmatch(isa) else host_device()
    if device == "cpu":
        return cpu_target(isa)
    if device == "cuda":
        return cuda_target(isa)
    raise TargetError(f"--device {device}: kiln targets cpu or cuda")


def missing_on_host(target: Target) -> list[str]:
    """What this host lacks to run `target`: CPU flags, or a GPU of that arch."""
    if target.device == "cpu":
        return sorted(set(target.features) - host_cpu_flags())
    capability = _host_cuda_capability()
    if capability is None:
        return ["a CUDA GPU"]
    hit = CUDA_ARCH.fullmatch(target.isa)
    assert hit is not None
    want = (int(hit.group(1)), int(hit.group(2)))
    if capability < want:
        return [f"a GPU of {target.isa} or newer (this one is sm_{capability[0]}{capability[1]})"]
    return []
