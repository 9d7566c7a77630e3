"""The content-addressed cache: keys from contents, hits without torch, one compile per key
under concurrency, nothing partial after a crash, and reuse across CI jobs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.args import ServerArgs
from kiln.compiler.key import compile_key
from kiln.compiler.store import Store
from kiln.core.artefact import read_manifest, verify_files
from kiln.paths import cache_dir

# A target level other than this host's own (CI machines have AVX2 or more).
OTHER = "x86-64"
COMPILE = (sys.executable, "-m", "kiln", "compile", "--model-path")


def kiln(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


def key(ckpt: Path, **kw) -> str:
    return compile_key(ServerArgs(model_path=str(ckpt), **kw)).key


def _flip_a_tensor_byte(f: Path, keep_mtime: bool = False) -> None:
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes, past the header
    f.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_key_is_contents_not_paths(checkpoint, tmp_path, fresh_cache) -> None:
    ckpt = tmp_path / "a"
    shutil.copytree(checkpoint("llama"), ckpt)
    first = key(ckpt)
    # Equivalent spellings are one key: auto resolves to float32 on CPU, aliases fold.
    assert key(ckpt, dtype="float32") == first == key(ckpt, dtype="float", load_format="auto")
    assert key(ckpt, tp_size=1, load_format="safetensors", target_isa="native") == first
    # The folder's name and place are not factors.
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    ckpt.rename(moved)
    assert key(moved) == first
    # One byte of one tensor is.
    _flip_a_tensor_byte(moved / "model.safetensors")
    assert key(moved) != first
    # So are the target and the compile-time flags.
    assert len({first, key(moved), key(moved, target_isa=OTHER), key(moved, page_size=4)}) == 4


def test_a_miss_is_explained_against_the_nearest_entry(checkpoint, tmp_path, fresh_cache) -> None:
    ckpt = checkpoint("llama")
    assert kiln("compile", "--model-path", str(ckpt)).returncode == 0
    done = kiln("compile", "--model-path", str(ckpt), "--page-size", "4", "--target-isa", OTHER)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cache miss; nearest entry ")
    assert "  --page-size: 1 -> 4" in lines
    assert any(x.startswith("  --target-isa: ") and x.endswith(f"-> {OTHER}") for x in lines)
    assert any(x.startswith("  target: cpu/") and x.endswith(f"-> cpu/{OTHER}") for x in lines)


def test_a_hit_imports_no_torch_and_cache_commands_work(checkpoint, tmp_path, fresh_cache) -> None:
    ckpt = checkpoint("llama")
    first = kiln("compile", "--model-path", str(ckpt))
    assert first.returncode == 0 and first.stdout.startswith("compiled: "), first.stderr
    entry = first.stdout.split()[1]
    assert Path(entry).parent == fresh_cache / "artefacts"
    probe = (
        "import sys; from kiln.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    for argv in (
        ["compile", "--model-path", str(ckpt), "-o", str(tmp_path / "out")],
        ["cache", "key", "--model-path", str(ckpt)],
        ["cache", "ls"],
        ["inspect", entry],
        ["inspect", entry, "--json"],
        ["inspect", entry, "--graph"],
        ["inspect", entry, "--dot"],
        ["diff", entry, str(tmp_path / "out")],
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (argv, done.stderr)
    hit = kiln("compile", "--model-path", str(ckpt), "-o", str(tmp_path / "out"))
    assert hit.stdout.startswith(f"cache hit: {tmp_path / 'out'} ")
    # -o holds hard links to the entry: no second copy of the weights on disk.
    w = "weights/rank0.safetensors"
    assert (tmp_path / "out" / w).stat().st_ino == (Path(entry) / w).stat().st_ino
    key_line = kiln("cache", "key", "--model-path", str(ckpt)).stdout.strip()
    assert Path(entry).name == key_line
    summary = json.loads(kiln("inspect", entry, "--json").stdout)
    assert summary["kernels"]["packed_linear -> kiln_cpu"] > 0 or summary["target"].endswith(
        "x86-64"
    )
    assert kiln("diff", entry, str(tmp_path / "out")).stdout.strip() == (
        "same cache key inputs, graph and files"
    )
    other = kiln("compile", "--model-path", str(ckpt), "--page-size", "4")
    other_entry = other.stdout.splitlines()[-1].split()[1]
    assert "--page-size: 1 -> 4" in kiln("diff", entry, other_entry).stdout
    listing = kiln("cache", "ls").stdout
    assert "2 entries" in listing
    assert kiln("cache", "gc", "--max-size", "1").returncode == 0
    assert "0 entries" in kiln("cache", "ls").stdout
    assert kiln("cache", "rm", "ffff").returncode == 2


def test_four_concurrent_compiles_of_one_key_compile_once(checkpoint, tmp_path, fresh_cache):
    ckpt = checkpoint("llama")
    procs = [
        subprocess.Popen(
            [*COMPILE, str(ckpt), "-o", str(tmp_path / f"out{i}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    states = sorted(o.split(":")[0] for o, _ in outs)
    assert states == ["cache hit", "cache hit", "cache hit", "compiled"]
    for i in range(4):
        verify_files(tmp_path / f"out{i}", read_manifest(tmp_path / f"out{i}"))
    assert len(Store().entries()) == 1


def test_kill_9_mid_compile_leaves_no_entry(checkpoint, tmp_path, fresh_cache) -> None:
    # Big enough (130 MB) that writing its weights takes a while to catch.
    ckpt = checkpoint("llama", num_layers=8, hidden_size=512, intermediate_size=2048)
    k = key(ckpt)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "compile", "--model-path", str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    artefacts = fresh_cache / "artefacts"
    deadline = time.time() + 120
    while time.time() < deadline and not list(artefacts.glob(f".{k}.tmp-*/*")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(artefacts.glob(f".{k}.tmp-*")), "the compile was not caught mid-way"
    assert not (artefacts / k).exists()
    again = kiln("compile", "--model-path", str(ckpt))
    assert again.returncode == 0 and again.stdout.startswith("compiled: ")
    verify_files(artefacts / k, read_manifest(artefacts / k))
    assert not list(artefacts.glob(".*.tmp-*"))  # the dead compile's staging was swept


def test_compiles_of_two_keys_into_one_folder_never_mix(checkpoint, tmp_path, fresh_cache):
    ckpt = checkpoint("llama")
    out = tmp_path / "art"
    for _ in range(3):
        procs = [
            subprocess.Popen(
                [*COMPILE, str(ckpt), "--page-size", str(ps), "-o", str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for ps in (1, 4)
        ]
        for p in procs:
            p.communicate(timeout=300)
            assert p.returncode == 0
        manifest = read_manifest(out)
        verify_files(out, manifest)
        assert manifest["compile_args"]["page_size"] in (1, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "kiln-cache"]


def test_a_second_ci_job_reuses_the_first_jobs_compile(checkpoint, tmp_path) -> None:
    """Two CI jobs: each a fresh working folder and process; the second restores the
    first's cache folder as actions/cache would (a copy: new inodes, same bytes and mtimes)
    and compiles the same checkpoint. Its compile is a hit, and it reads no tensor: a tensor
    byte flipped in place, with the file's mtime put back, goes unnoticed by the key."""
    ckpt = tmp_path / "models" / "tiny"
    shutil.copytree(checkpoint("llama"), ckpt)
    job1, job2 = tmp_path / "job1", tmp_path / "job2"
    for job in (job1, job2):
        job.mkdir()
    env1 = dict(os.environ, KILN_CACHE_DIR=str(job1 / "cache"))
    session_kernels = cache_dir() / "kernels"  # built already: spare job1 a 10 s C build
    if session_kernels.is_dir():
        shutil.copytree(session_kernels, job1 / "cache" / "kernels")
    env2 = dict(os.environ, KILN_CACHE_DIR=str(job2 / "cache"))
    k1 = kiln("cache", "key", "--model-path", str(ckpt), env=env1, cwd=job1).stdout.strip()
    first = kiln("compile", "--model-path", str(ckpt), "-o", "art", env=env1, cwd=job1)
    assert first.returncode == 0 and first.stdout.startswith("compiled: "), first.stderr

    shutil.copytree(job1 / "cache", job2 / "cache")  # actions/cache restore
    _flip_a_tensor_byte(ckpt / "model.safetensors", keep_mtime=True)
    k2 = kiln("cache", "key", "--model-path", str(ckpt), env=env2, cwd=job2).stdout.strip()
    second = kiln("compile", "--model-path", str(ckpt), "-o", "art", env=env2, cwd=job2)
    assert second.returncode == 0 and second.stdout.startswith("cache hit: art "), second.stderr
    assert k1 == k2
    # Asked to, the key reads every byte again and sees the change.
    rehashed = kiln("cache", "key", "--model-path", str(ckpt), "--rehash", env=env2).stdout
    assert rehashed.strip() != k1
    verify_files(job2 / "art", read_manifest(job2 / "art"))


@pytest.mark.parametrize("level", ["x86-64", "avx2"])
def test_compiling_for_another_machine(checkpoint, tmp_path, level) -> None:
    """A compile for a lower level than this host's runs here too (the fleet's machines
    have at least that level): same greedy tokens as the host build."""
    from kiln import Engine

    ckpt = checkpoint("llama")
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outs = []
    for isa in ("native", level):
        done = kiln(
            "compile", "--model-path", str(ckpt), "--target-isa", isa, "-o", str(tmp_path / isa)
        )
        assert done.returncode == 0, done.stderr
        outs.append(
            Engine(tmp_path / isa, max_total_tokens=256).generate(
                input_ids=[1, 5, 9], sampling_params=params
            )
        )
    assert read_manifest(tmp_path / level)["target"]["isa"] == level
    assert outs[0]["output_ids"] == outs[1]["output_ids"]


def test_every_kiln_module_a_compile_runs_is_in_the_key(checkpoint, tmp_path) -> None:
    """A change to any source a compile runs (the op definitions and quantization maths in
    kiln.core included) changes the key, so no stale artefact is ever a cache hit."""
    script = f"""
import sys
from pathlib import Path
from kiln.args import ServerArgs
from kiln.compiler.compile import compile_model
from kiln.compiler.key import source_files
compile_model(ServerArgs(model_path={str(checkpoint("llama"))!r}), {str(tmp_path / "art")!r})
hashed = {{f.resolve() for _, f in source_files()}}
ran = {{m: Path(mod.__file__).resolve() for m, mod in list(sys.modules.items())
        if m.startswith("kiln") and getattr(mod, "__file__", None)}}
print(sorted(m for m, f in ran.items() if f not in hashed))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_miss_trims_the_cache_to_its_bound(checkpoint, tmp_path, fresh_cache) -> None:
    """$KILN_CACHE_MAX_SIZE bounds the cache: a compile that misses removes the least
    recently used entries past it, never the one it built; an -o copy outlives its entry."""
    ckpt = checkpoint("llama")
    first = kiln("compile", "--model-path", str(ckpt), "-o", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    (entry,) = Store().entries()
    room = {**os.environ, "KILN_CACHE_MAX_SIZE": str(int(entry.bytes * 1.5))}
    bad = kiln(
        "compile",
        "--model-path",
        str(ckpt),
        "--page-size",
        "4",
        env={**room, "KILN_CACHE_MAX_SIZE": "lots"},
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "kiln compile: error: KILN_CACHE_MAX_SIZE 'lots': expected a size such as 20G, 500M or 1T"
    )
    assert [e.key for e in Store().entries()] == [entry.key]  # refused before compiling
    second = kiln("compile", "--model-path", str(ckpt), "--page-size", "4", env=room)
    assert second.returncode == 0, second.stderr
    assert f"removed {entry.key[:16]}" in second.stderr
    (kept,) = Store().entries()
    assert kept.key != entry.key
    verify_files(tmp_path / "a", read_manifest(tmp_path / "a"))  # the -o copy is whole
    # One entry over the bound on its own stays: the entry just built is never removed.
    alone = kiln(
        "compile",
        "--model-path",
        str(ckpt),
        "--page-size",
        "8",
        env={**room, "KILN_CACHE_MAX_SIZE": "1"},
    )
    assert alone.returncode == 0, alone.stderr
    assert [e.manifest["cache_key"] for e in Store().entries()] == [key(ckpt, page_size=8)]
    unbounded = {**room, "KILN_CACHE_MAX_SIZE": "none"}
    assert kiln("compile", "--model-path", str(ckpt), env=unbounded).returncode == 0
    assert len(Store().entries()) == 2
    assert kiln("cache", "ls", env=unbounded).stdout.rstrip().endswith("(no bound)")
    listing = kiln("cache", "ls", env={**room, "KILN_CACHE_MAX_SIZE": "1M"}).stdout
    assert listing.rstrip().endswith("(bound 1M)")
