"""An artefact runs on the machines its target names, with the kiln and torch it was built
with, and loads only native code this user built or chose to trust."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_untrusted_artefact import edit_json

from kiln import Engine
from kiln.core.artefact import ArtefactError
from kiln.kernels import native
from kiln.runtime.artefact import Artefact


@pytest.fixture
def copy(artefact, tmp_path) -> Path:
    art = tmp_path / "art"
    shutil.copytree(artefact("llama"), art)
    return art


def test_a_target_this_host_lacks_is_refused_naming_what_is_missing(copy) -> None:
    def retarget(m: dict) -> dict:
        m["target"]["features"] = [*m["target"]["features"], "avx10_2"]
        return m

    edit_json(copy, "manifest.json", retarget)
    with pytest.raises(ArtefactError) as e:
        Engine(copy, max_total_tokens=64)
    msg = str(e.value)
    assert "\n" not in msg and "lacks avx10_2" in msg
    assert "kiln compile --model-path" in msg and "--target-isa native" in msg


def test_a_cuda_artefact_on_a_machine_without_a_gpu(copy) -> None:
    def retarget(m: dict) -> dict:
        m["target"] = {"device": "cuda", "isa": "sm_90", "features": []}
        return m

    edit_json(copy, "manifest.json", retarget)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ArtefactError, match=r"compiled for cuda/sm_90; this machine lacks a CUDA"):
        Engine(copy, max_total_tokens=64)


@pytest.mark.parametrize("name", ["kiln", "torch"])
def test_versions_minor_refuses_patch_warns(copy, name, caplog) -> None:
    ours = json.loads((copy / "manifest.json").read_text())[f"{name}_version"]
    major, minor, *_ = ours.split("+")[0].split(".")

    def version(v: str):
        return lambda m: {**m, f"{name}_version": v}

    edit_json(copy, "manifest.json", version(f"{major}.{int(minor) + 1}.0"))
    with pytest.raises(ArtefactError, match=rf"compiled with {name} {major}\.{int(minor) + 1}\.0"):
        Artefact.open(copy)
    edit_json(copy, "manifest.json", version(f"{major}.{minor}.999"))
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        Artefact.open(copy)
    assert f"compiled with {name} {major}.{minor}.999" in caplog.text


def test_a_swapped_kernel_library_is_never_loaded(copy) -> None:
    """Replacing kernels/cpu_kernels.so (checksums recomputed) does not get it loaded: no
    build of this user's has that checksum, and loading never compiles; one line names the
    `kiln compile` that builds the kernels here."""
    lib = copy / "kernels/cpu_kernels.so"
    lib.write_bytes(lib.read_bytes() + b"\0")

    def reseal(m: dict) -> dict:
        from kiln.core.artefact import sha256_file

        m["native"]["sha256"] = sha256_file(lib)
        return m

    edit_json(copy, "manifest.json", reseal)
    built = sorted(native.store().glob("cpu_kernels-*.so"))
    with pytest.raises(ArtefactError) as e:
        Artefact.open(copy)
    assert "\n" not in str(e.value) and "kiln compile --model-path" in str(e.value)
    assert sorted(native.store().glob("cpu_kernels-*.so")) == built  # nothing was built


def test_a_library_built_elsewhere_needs_trust_remote_code(copy, tmp_path) -> None:
    """A machine with no C compiler and no kernel store of its own (a serving fleet)."""
    code = """
import sys
from kiln.runtime.artefact import Artefact
from kiln.core.artefact import ArtefactError
try:
    Artefact.open(sys.argv[1])
except ArtefactError as e:
    print("refused:", e)
art = Artefact.open(sys.argv[1], trust_remote_code=True)
print("loaded:", art.lib._name)
"""
    env = dict(os.environ, CC=str(tmp_path / "no-cc"), KILN_CACHE_DIR=str(tmp_path / "fresh"))
    done = subprocess.run(
        [sys.executable, "-c", code, str(copy)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    refused, loaded = done.stdout.strip().splitlines()
    assert "were not built by kiln on this machine" in refused
    assert "--trust-remote-code" in refused and "kiln compile --model-path" in refused
    assert loaded == f"loaded: {copy / 'kernels/cpu_kernels.so'}"


def test_trust_remote_code_reaches_every_tensor_parallel_rank(artefact, tmp_path) -> None:
    """The other ranks load the same artefact's native code in their own processes: with
    --trust-remote-code they load it as rank 0 does (they once refused, and the engine
    died at its first step)."""
    env = dict(os.environ, CC=str(tmp_path / "no-cc"), KILN_CACHE_DIR=str(tmp_path / "fresh"))

    def generate(art: Path) -> str:
        argv = ["generate", str(art), "--prompt", "Hello", "--max-new-tokens", "6"]
        done = subprocess.run(
            [sys.executable, "-m", "kiln", *argv, "--trust-remote-code"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert "built elsewhere (--trust-remote-code)" in done.stderr
        return done.stdout

    assert generate(artefact("llama", compile_args={"tp_size": 2})) == generate(artefact("llama"))
