"""The README's commands are the ones a user should run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    readme = ROOT / "README.md"
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
    lines = [line for b in blocks for line in b.splitlines()]
    lines += (ROOT / "examples/quickstart.sh").read_text().splitlines()
    return [x for x in lines if re.search(r"\bkiln (compile|launch)\b", x)]


def test_readme_compiles_take_the_fast_cpu_path() -> None:
    """On CPU only fp32 runs kiln's fast kernels; SGLang's `auto` gives fp16 for an fp32
    checkpoint. Every compile the README and quickstart show must say float32."""
    commands = _commands()
    assert len(commands) >= 4
    for cmd in commands:
        assert "--dtype float32" in cmd, cmd
