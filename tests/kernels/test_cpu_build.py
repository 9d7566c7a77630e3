"""kiln_cpu's build: made at compile time for the target's x86-64 level (never `native`),
kept in the kernel store, carried in the artefact; without a C compiler the compiler picks
the reference kernels for the whole graph, and says so once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from native_libs import HOST_LEVELS

from kiln.core.target import cpu_target
from kiln.kernels import native

SHAPES = {"x86-64": (8, 3), "avx2": (8, 3), "avx512": (16, 4), "avx512_vnni": (16, 4)}


@pytest.mark.parametrize("level", HOST_LEVELS)
def test_each_level_builds_once_with_its_own_flags(level: str) -> None:
    # The session's store, which the kernel tests build each level into: a build of its
    # own had cost every level's compile twice (the baseline's 45 s on a Zen 3).
    toolchain = native.Toolchain.find()
    assert toolchain is not None
    target = cpu_target(level)
    first = native.build(target, toolchain)
    stamp = first.stat().st_mtime_ns
    assert native.build(target, toolchain) == first
    assert first.stat().st_mtime_ns == stamp
    assert not list(first.parent.glob(f"{first.name}.*.tmp"))  # no temporary of its own
    assert f"-march={target.march}" in native.flags(target)
    assert "-march=native" not in native.flags(target)
    assert [f for f in native.flags(target) if f.startswith("-O")] == [
        "-O2" if level == "x86-64" else "-O3"
    ]
    # GCC optimises the one translation unit in partitions on every core (24 -> 14 s),
    # where it can link with LTO (CI's can; a GPU machine's image could not)
    lto = native._links_with_lto(toolchain)
    assert ("-flto=auto" in native.library_flags(target, toolchain)) == lto
    lib = native.load(first)
    assert (lib.kiln_linear_lanes(), lib.kiln_linear_group_panels()) == SHAPES[level]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
@pytest.mark.parametrize("level", [lv for lv in HOST_LEVELS if not lv.startswith("avx512")])
def test_a_build_uses_no_instruction_above_its_level(level: str) -> None:
    toolchain = native.Toolchain.find()
    assert toolchain is not None
    lib = native.build(cpu_target(level), toolchain)  # the session store's, as kernels use
    asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "vfmadd" not in asm or level != "x86-64"
    assert "%zmm" not in asm  # AVX-512 registers: only in the avx512 build
    if level == "avx2":
        assert "%ymm" in asm and "vfmadd" in asm


def test_compile_errors_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    toolchain = native.Toolchain.find()
    assert toolchain is not None
    with pytest.raises(native.KernelBuildError, match="failed on bad.c"):
        native.build(cpu_target("x86-64"), toolchain, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_a_gcc_that_cannot_link_with_lto_builds_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GPU machine's image had a gcc whose `ld` "could not run lto-wrapper": every CPU
    # compile failed there. A compiler that refuses -flto now builds without it.
    real = native.Toolchain.find()
    assert real is not None and "clang" not in real.version.lower()
    cc = tmp_path / "gcc-no-lto"
    cc.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in -flto*) '
        'echo "ld: error: could not run lto-wrapper" >&2; exit 1;; esac; done\n'
        f'exec {real.cc} "$@"\n'
    )
    cc.chmod(0o755)
    broken = native.Toolchain(str(cc), real.version)
    target = cpu_target("x86-64")
    assert "-flto=auto" not in native.library_flags(target, broken)
    if native._links_with_lto(real):
        assert native.build_id(target, broken) != native.build_id(target, real)
    small = tmp_path / "small.c"
    small.write_text("long kiln_abi_version(void) { return 0; }\n")
    monkeypatch.setattr(native, "SOURCE", small)
    lib = native.build(target, broken, tmp_path / "out")
    assert lib.is_file()


def test_a_killed_builders_temporaries_are_swept(tmp_path: Path) -> None:
    # kill -9 of `kiln compile` mid-build leaves `<lib>.<pid>.tmp` in the store (CI's first
    # run of the session-store build test found one); the next build removes it, but never
    # a temporary of a builder that still runs.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = [f"step-0.so.{gone.pid}.tmp", f"step-0.c.{gone.pid}.tmp.c"]
    live = [f"step-1.so.{os.getppid()}.tmp", f"cpu_kernels-1.so.{os.getpid()}.tmp", "step-1.so"]
    for name in dead + live:
        (tmp_path / name).write_bytes(b"")
    # a builder's work folder, as this kiln leaves one
    (tmp_path / f"step-2.so.{gone.pid}.tmp").mkdir()
    (tmp_path / f"step-2.so.{gone.pid}.tmp" / "step-2.c").write_text("int x;")
    native.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(live)


STEP_PROBE = """
import sys
from kiln.core.target import cpu_target
from kiln.kernels import native
lib = native.build_step("int kiln_probe(void) { return 7; }\\n", cpu_target("x86-64"),
                        native.Toolchain.find())
print(lib)
"""


def test_builders_write_the_same_library_and_the_first_one_stays(tmp_path: Path) -> None:
    """Two `kiln compile`s sharing a cache may build one step at once. Every builder writes
    the same bytes (a process's own names never reach the library), and a builder that
    finishes second leaves the first library in place: an artefact made with it keeps a
    checksum the store holds (an artefact's step is trusted only then)."""
    libs = []
    for store in ("a", "b"):  # two processes, two pids
        env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / store))
        done = subprocess.run(
            [sys.executable, "-c", STEP_PROBE], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        libs.append(Path(done.stdout.strip()))
    assert libs[0].name == libs[1].name and libs[0].read_bytes() == libs[1].read_bytes()
    assert libs[0].with_suffix(".c").read_text().startswith("int kiln_probe")
    first = libs[0].stat().st_ino
    late = tmp_path / "late.so"
    late.write_bytes(b"a racing builder's library")
    native._publish(late, libs[0])
    assert libs[0].stat().st_ino == first and libs[0].read_bytes() == libs[1].read_bytes()
    assert [p.name for p in libs[0].parent.iterdir() if ".tmp" in p.name] == []


def _kiln(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_without_a_compiler_the_graph_runs_reference_kernels(checkpoint, tmp_path: Path) -> None:
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), KILN_CACHE_DIR=str(tmp_path / "c"))
    ckpt = checkpoint("llama")
    args = ("--model-path", str(ckpt), "--device", "cpu", "-o", str(tmp_path / "art"))
    done = _kiln("compile", *args, env=env)
    assert done.returncode == 0, done.stderr
    warnings = [ln for ln in done.stderr.splitlines() if "no C compiler" in ln]
    assert len(warnings) == 1 and "no-such-cc" in warnings[0], done.stderr
    graph = json.loads((tmp_path / "art/graph.json").read_text())
    backends = {n["meta"].get("backend") for n in graph["nodes"]} - {None}
    assert backends == {"torch_native"}
    assert not (tmp_path / "art/kernels").exists()
    manifest = json.loads((tmp_path / "art/manifest.json").read_text())
    assert manifest["native"] is None
    assert manifest["cache_factors"]["native_toolchain"] is None
    gen = _kiln("generate", str(tmp_path / "art"), "--prompt", "Hello", env=env)
    assert gen.returncode == 0, gen.stderr
