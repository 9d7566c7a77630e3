"""The kernels' thread count without torch (runtime/threads.py): torch's own default, and
handed to torch whenever torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.runtime.threads import physical_cores


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "1"}, {"MKL_NUM_THREADS": "1"}])
def test_the_default_count_is_torchs(env: dict[str, str]) -> None:
    code = (
        "from kiln.runtime.threads import default_threads\n"
        "count, _ = default_threads()\n"
        "import torch\n"
        "print(count, torch.get_num_threads())"
    )
    ours, torchs = _run(code, **env).split()
    assert ours == torchs


def test_a_count_set_before_torch_is_torchs_once_imported() -> None:
    """A server that started without torch (--threads 1) imports it for a sampled
    request: torch's ops then run on the one thread too."""
    code = (
        "import sys\n"
        "from kiln.runtime import sampler\n"
        "from kiln.runtime.threads import set_threads\n"
        "set_threads(1)\n"
        "assert 'torch' not in sys.modules\n"
        "sampler.as_tensor(__import__('numpy').zeros(3, 'float32'))\n"
        "import torch\n"
        "print(torch.get_num_threads())"
    )
    assert _run(code) == "1"


def test_physical_cores_counts_cores_not_hyperthreads(tmp_path) -> None:
    block = "processor\t: {p}\nphysical id\t: {s}\ncore id\t\t: {c}\n"
    text = "\n".join(block.format(p=i, s=i // 4, c=(i % 4) // 2) for i in range(8))
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert physical_cores(cpuinfo) == 4  # 2 packages x 2 cores x 2 threads
    assert physical_cores(cpuinfo, cpus={4, 5, 6, 7}) == 2  # one package (a NUMA node's)
    assert physical_cores(cpuinfo, cpus={0, 1}) == 1  # one core's two threads
    cpuinfo.write_text("processor\t: 0\n\nprocessor\t: 1\n")  # no core ids: processors
    assert physical_cores(cpuinfo) == 2
