"""torch taken on a background thread (kiln/core/lazy.py's prefetch): its shared libraries
are opened by a dlopen that lets go of the GIL, before the import, so a serving process's
event loop keeps answering while the dynamic loader runs libtorch's constructors (the
stall itself: tests/serve/test_hardening.py's /health test)."""

from __future__ import annotations

import subprocess
import sys


def test_torchs_libraries_are_open_before_its_import_and_the_import_uses_them() -> None:
    code = (
        "import sys\n"
        "from kiln.core import lazy\n"
        "lazy._open_libraries('torch')\n"
        "assert 'torch' not in sys.modules\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libtorch_cpu.so' in maps, '/torch/_C.' in maps)\n"
        "lazy._load('torch')\n"
        "import torch\n"
        "print(float(torch.arange(4.0).sum()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True True", "6.0"]


def test_a_process_that_exits_while_torch_opens_exits_cleanly() -> None:
    """The exit waits for a library being opened without the GIL: exit() running static
    destructors under libtorch's constructors was a segfault (2 of 3 exits 0.1-0.2 s after
    the prefetch began, before the wait)."""
    for delay in (0.1, 0.2):
        code = (
            "import time\n"
            "from kiln.core import lazy\n"
            "lazy.prefetch('torch')\n"
            f"time.sleep({delay})\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (delay, r.returncode, r.stderr[-2000:])
