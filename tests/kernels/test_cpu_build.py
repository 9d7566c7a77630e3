"""kiln_cpu's build: compiled once per machine and cached, chosen by select_backends for
fp32 CPU graphs, and a clean fallback where no C compiler exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.kernels import cpu


def test_library_builds_here_and_is_cached(tmp_path: Path) -> None:
    assert cpu.available(), "CI has gcc: the C kernels must build, not fall back"
    first = cpu.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left


def test_no_compiler_falls_back_with_one_warning(tmp_path: Path) -> None:
    code = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from kiln.kernels import cpu, torch_native
x, w = torch.randn(4, 32), torch.randn(32)
assert not cpu.available()
assert torch.equal(cpu.rmsnorm(x, w, 1e-5), torch_native.rmsnorm(x, w, 1e-5))
cpu.rmsnorm(x, w, 1e-5)
print("ok")
"""
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), KILN_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    warnings = [ln for ln in done.stderr.splitlines() if "kiln_cpu kernels unavailable" in ln]
    assert len(warnings) == 1 and "no-such-cc" in warnings[0]


def test_compile_errors_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu, "SOURCE", bad)
    with pytest.raises(cpu.KernelBuildError, match="failed on bad.c"):
        cpu.build(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tmp"))
