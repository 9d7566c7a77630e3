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
