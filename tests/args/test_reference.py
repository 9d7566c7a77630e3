"""kiln's flags against the SGLang reference documents in ../shared/reference.

The tests read the reference tables themselves, so a flag added there and not here fails.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from kiln.args import SPELLINGS, ArgError, ServerArgs, add_cli_args

REFERENCE = Path(
    os.environ.get("KILN_REFERENCE_DIR", Path(__file__).resolve().parents[3] / "shared/reference")
)
DOCS = ("sglang-server-arguments.md", "sglang-ascend-npu-support.md")


def reference_rows() -> list[tuple[str, list[str], list[str]]]:
    """(document, flag spellings, remaining cells) for every flag row of both documents."""
    if not REFERENCE.is_dir():
        pytest.fail(f"reference documents not found at {REFERENCE} (set KILN_REFERENCE_DIR)")
    rows = []
    for doc in DOCS:
        for line in (REFERENCE / doc).read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("|") or "`--" not in cells[0]:
                continue
            names: list[str] = []
            for part in re.split(r"<br\s*/?>", cells[0]):
                part = part.strip().strip("`").strip()
                if names and names[-1].endswith("-"):
                    names[-1] += part  # a long name wrapped over several lines
                elif part.startswith("--"):
                    names.append(part)
            rows.append((doc, names, cells[1:]))
    return rows


def all_spellings() -> list[str]:
    return sorted({name for _, names, _ in reference_rows() for name in names})


def test_the_reference_is_the_size_we_expect() -> None:
    assert len(all_spellings()) >= 320


@pytest.mark.parametrize("spelling", all_spellings())
def test_every_reference_spelling_is_recognised(spelling: str) -> None:
    """The flag parses; kiln either accepts the value or refuses it with an error naming
    the flag, never 'unrecognized arguments' and never silence."""
    flag = SPELLINGS.get(spelling)
    assert flag is not None, f"{spelling} is not a kiln flag"
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_cli_args(parser)
    value = _sample_value(flag)
    ns = parser.parse_args([spelling, *value])
    assert flag.dest in vars(ns)
    try:
        args = ServerArgs.from_namespace(ns)
    except ArgError as e:
        assert any(name in str(e) for name in flag.flags), f"error does not name it: {e}"
        return
    assert args.to_dict()[flag.dest] is not None


def _sample_value(flag) -> list[str]:
    if flag.type == "bool":
        return []
    if flag.choices:
        return [str(flag.choices[0])]
    sample = {"int": "2", "float": "0.5", "str": "x"}[
        flag.type[5:-1] if flag.is_list else flag.type
    ]
    return [sample]


def _reference_default(raw: str, flag) -> object:
    raw = raw.replace("`", "").strip()
    if raw in ("None", "", "N/A"):
        return None if flag.type != "bool" else False
    if flag.type == "bool":
        return raw == "True"
    if flag.is_list:
        return () if raw == "[]" else raw
    if flag.type == "int":
        return int(raw)
    if flag.type == "float":
        return float(raw)
    return raw


def test_defaults_and_choices_follow_the_main_reference() -> None:
    checked = 0
    for doc, names, cells in reference_rows():
        if doc != DOCS[0] or len(cells) < 3:
            continue
        flag = SPELLINGS[names[0]]
        _, default, options = cells[0], cells[1], cells[2]
        if flag.dest == "lora_paths":  # its options cell holds a format description
            continue
        assert flag.default == _reference_default(default, flag), names[0]
        choices = re.findall(r"`([^`]+)`", options)
        if choices and "Type" not in options and flag.choices:
            assert [str(c) for c in flag.choices] == choices, names[0]
        checked += 1
    assert checked > 250


@pytest.mark.parametrize(
    "spellings, dest",
    [
        (("--tp", "--tp-size", "--tensor-parallel-size"), "tp_size"),
        (("--dp", "--dp-size", "--data-parallel-size"), "dp_size"),
        (("--ep", "--ep-size", "--expert-parallel-size"), "ep_size"),
        (("--model", "--model-path"), "model_path"),
        (("--dist-init-addr", "--nccl-init-addr"), "dist_init_addr"),
    ],
)
def test_aliases_share_one_field(spellings, dest) -> None:
    assert {SPELLINGS[s].dest for s in spellings} == {dest}
