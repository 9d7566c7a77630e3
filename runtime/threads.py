"""The kernels' thread count, without torch.

kiln's native step, its C kernels and torch's intra-op pool run with one count: --threads,
else torch's own default (OMP_NUM_THREADS or MKL_NUM_THREADS when set, else one thread
per physical core of the machine, as ATen's `intraop_default_num_threads` counts them).
It is kept here so that a server that never imports torch (runtime/weights.py) runs with
the count torch would have had, and handed to torch whenever torch comes."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from kiln.core.lazy import on_import

_count: int | None = None


def threads() -> int:
    """The count kernels run with."""
    return _count if _count is not None else default_threads()[0]


def set_threads(n: int) -> None:
    """Run every kernel, kiln's and torch's (now or once imported), on `n` threads."""
    global _count
    if n < 1:
        raise ValueError(f"a thread count of {n}")
    _count = n
    on_import("torch", _apply)


def _apply(torch: Any) -> None:
    if _count is not None and torch.get_num_threads() != _count:
        torch.set_num_threads(_count)


def default_threads() -> tuple[int, str]:
    """torch's count, and where it comes from: the one it would start with, or, once it
    is imported, its own (a program may have set it before making an engine)."""
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            count, source = int(value), f"{var}={value}"
            break
    else:
        count, source = physical_cores(), "one per core"
    if "torch" in sys.modules:
        count = sys.modules["torch"].get_num_threads()
    return count, source


def physical_cores(cpuinfo: Path = Path("/proc/cpuinfo"), cpus: set[int] | None = None) -> int:
    """Distinct (package, core) pairs of /proc/cpuinfo, of the processors in `cpus` if
    given; the processor count where it does not say (as cpuinfo, which ATen asks, falls
    back)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return len(cpus) if cpus else os.cpu_count() or 1
    cores, processors = set(), 0
    for block in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in block.splitlines())
        )
        if "processor" not in fields:
            continue
        if cpus is not None and int(fields["processor"]) not in cpus:
            continue
        processors += 1
        if "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    processors = processors or (len(cpus) if cpus else os.cpu_count() or 1)
    return len(cores) if 0 < len(cores) < processors else processors
