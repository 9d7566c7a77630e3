"""The README's commands are the ones a user should run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kiln.args import ServerArgs

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    readme = ROOT / "README.md"
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
    lines = [line for b in blocks for line in b.splitlines()]
    lines += (ROOT / "examples/quickstart.sh").read_text().splitlines()
    return [x for x in lines if re.search(r"\bkiln (compile|launch)\b", x)]


def test_readme_compile_commands_parse_as_shown() -> None:
    """Every compile and launch the README and quickstart show is a valid command line (no
    stale or misspelled flag), and none needs `--dtype` for CPU speed any more: `auto` is
    fp32 on CPU targets (tests/compiler/test_artefact.py)."""
    commands = _commands()
    assert len(commands) >= 6
    for cmd in commands:
        words = shlex.split(cmd.split("#")[0])
        rest = words[words.index("kiln") + 2 :]
        for own in ("-o", "--artefact-dir"):  # the subcommands' own options
            if own in rest:
                del rest[rest.index(own) : rest.index(own) + 2]
        args = ServerArgs.from_cli(rest)
        assert args.model_path, cmd
