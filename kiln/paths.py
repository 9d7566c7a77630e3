"""Where kiln keeps what it makes for the user: artefacts compiled by `kiln launch`,
kernels built for this machine. `KILN_CACHE_DIR` moves all of it."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln"))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (on this machine); leftovers named with a dead pid are
    a killed process's and safe to remove."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
