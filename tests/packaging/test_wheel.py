"""The package as pip builds it: every source file inside, no build warnings."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kiln": "kiln",
    "compiler": "kiln/compiler",
    "runtime": "kiln/runtime",
    "models": "kiln/models",
    "kernels": "kiln/kernels",
    "passes": "kiln/passes",
    "serve": "kiln/serve",
}


def test_wheel_holds_every_source_file_and_builds_quietly(tmp_path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    (wheel,) = tmp_path.glob("kiln-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, installed in PACKAGES.items():
        for f in (ROOT / folder).rglob("*"):
            if f.suffix in (".py", ".c") and "__pycache__" not in f.parts:
                expected.add(f"{installed}/{f.relative_to(ROOT / folder).as_posix()}")
    assert expected - inside == set()


def test_a_checkout_root_shadows_no_package_once_kiln_is_imported() -> None:
    """`python -m`/`-c` run from the checkout put its root on the path, where `kernels/`
    would stand in for Hugging Face's `kernels` (imported by transformers' models)."""
    probe = (
        "import importlib.util, kiln\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else None)\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,"
        " num_attention_heads=1, vocab_size=16))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(ROOT / "kernels") not in r.stdout, r.stdout
