"""kiln_cpu's build: compiled once per machine and cached, chosen by select_backends for
fp32 CPU graphs, and a clean fallback where no C compiler exists."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.kernels import cpu, registry
from kiln.kernels.attention import AttentionBatch, SeqSpan


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


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for the x86-64 baseline")
def test_code_without_avx_is_correct_too(tmp_path: Path) -> None:
    # CI machines have AVX; the library built for the x86-64 baseline takes the portable
    # branches (no AVX intrinsics) and must agree with the reference as well.
    lib = cpu.load(cpu.build(tmp_path, march="x86-64"))
    torch.manual_seed(3)
    heads, kv_heads, d, page = 6, 2, 64, 4
    lens = [37, 5, 1]
    kc, vc = torch.randn(1, kv_heads, 256, d), torch.randn(1, kv_heads, 256, d)
    spans = []
    for i, n in enumerate(lens):
        pages = torch.arange(i * 16, i * 16 + -(-n // page))
        slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:n]
        spans.append(SeqSpan(i, 1, n, slots, pages))
    batch = AttentionBatch.build(kc, vc, spans, page_size=page)
    q = torch.randn(len(lens), heads * d)
    ours = cpu._decode(lib, batch, q, kc[0], vc[0], heads, kv_heads, None, d**-0.5)
    reference = registry.get("attention", "torch_native").fn
    # The reference writes each sequence's newest K/V row first: give it what is there.
    kc_rows = kc[0][:, batch.out_slots].transpose(0, 1).reshape(len(lens), -1)
    vc_rows = vc[0][:, batch.out_slots].transpose(0, 1).reshape(len(lens), -1)
    ref = reference(
        batch,
        q,
        kc_rows,
        vc_rows,
        layer=0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        scale=d**-0.5,
        sliding_window=None,
    )
    torch.testing.assert_close(ours, ref)
    # The linear's portable build: 8-lane blocks and 8-row tiles.
    assert lib.kiln_linear_lanes() == 8 and lib.kiln_linear_tile_rows() == 8
    x, w, b = torch.randn(9, 40), torch.randn(100, 40), torch.randn(100)
    packed = torch.empty(13 * 40 * 8)
    lib.kiln_pack_linear_f32(w.data_ptr(), 100, 40, packed.data_ptr(), 2)
    out = torch.empty(9, 100)
    assert (
        lib.kiln_linear_f32(
            x.data_ptr(), 9, 40, packed.data_ptr(), 100, b.data_ptr(), out.data_ptr(), 2
        )
        == 0
    )
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
