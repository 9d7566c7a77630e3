"""Where kiln keeps what it makes for the user: artefacts compiled by `kiln launch`,
kernels built for this machine. `KILN_CACHE_DIR` moves all of it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln"))
