"""ServerArgs: every server argument in one frozen tree, built once at the boundary.

    args = ServerArgs.from_cli(["--model", "ckpt", "--tp", "2"])
    args.memory_and_scheduling.page_size    # the tree, one frozen dataclass per section
    args.page_size                          # flat access, as SGLang code reads it
    ServerArgs(model_path="ckpt", page_size=4)   # from Python: flat keyword names

Precedence: defaults < `--config` YAML < command line. Every value is checked when the
tree is built (types, choices, ranges, support status, cross-field rules); errors are one
line naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kiln.args.flags import Flag, Stage
from kiln.args.spec import FLAGS, SECTION_OF, SECTIONS, SPELLINGS, ArgError
from kiln.args.validate import translate_deprecated, validate

log = logging.getLogger("kiln.args")


def _section_class(attr: str, flags: Iterable[Flag]) -> type:
    name = "".join(w.capitalize() for w in attr.split("_")) + "Args"
    fields = [
        (f.dest, f.annotation, dataclasses.field(default=f.default, metadata={"flag": f}))
        for f in flags
    ]
    return dataclasses.make_dataclass(name, fields, frozen=True)


SECTION_CLASSES: dict[str, type] = {s.attr: _section_class(s.attr, s.flags) for s in SECTIONS}


# Flags whose values are credentials: never shown (/get_server_info) or written (crash dumps).
SECRET_ARGS = ("api_key", "admin_api_key")


class ServerArgs:
    """The argument tree. Immutable; `replace` returns a new, re-validated tree."""

    __slots__ = ("_sections",)
    _sections: dict[str, Any]

    def __init__(self, **values: Any) -> None:
        groups: dict[str, dict[str, Any]] = {attr: {} for attr in SECTION_CLASSES}
        values, origin = translate_deprecated(values)
        for dest, value in values.items():
            flag = FLAGS.get(dest)
            if flag is None:
                raise ArgError(f"unknown argument {dest!r}")
            groups[SECTION_OF[dest]][dest] = _coerce(flag, value)
        sections = {attr: cls(**groups[attr]) for attr, cls in SECTION_CLASSES.items()}
        object.__setattr__(self, "_sections", sections)
        validate(self, origin)

    # -- access -----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        sections = object.__getattribute__(self, "_sections")
        attr = SECTION_OF.get(name)
        if attr is not None:
            return getattr(sections[attr], name)
        if name in sections:
            return sections[name]
        raise AttributeError(f"ServerArgs has no argument {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to {name!r}: ServerArgs is frozen")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServerArgs) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.non_defaults().items())))

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.non_defaults().items())
        return f"ServerArgs({changed})"

    def to_dict(self, stage: Stage | None = None) -> dict[str, Any]:
        return {d: getattr(self, d) for d, f in FLAGS.items() if stage is None or f.stage == stage}

    def stage_values(self, stage: Stage) -> dict[str, Any]:
        return self.to_dict(stage)

    def non_defaults(self) -> dict[str, Any]:
        return {d: v for d, v in self.to_dict().items() if v != FLAGS[d].default}

    def replace(self, **changes: Any) -> ServerArgs:
        return ServerArgs(**{**self.non_defaults(), **changes})

    # -- construction from the command line and YAML -------------------------------------
    @classmethod
    def from_cli(
        cls, argv: Sequence[str] | None = None, prog: str = "kiln", stages: Sequence[Stage] = ()
    ) -> ServerArgs:
        parser = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS)
        add_cli_args(parser, stages)
        return cls.from_namespace(parser.parse_args(argv))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**explicit_values(ns))


def explicit_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The values a user gave (YAML from --config first, then the command line over it).

    Needs a parser built with `argument_default=argparse.SUPPRESS` so that only given flags
    appear in the namespace."""
    given = {k: v for k, v in vars(ns).items() if k in FLAGS}
    config = given.get("config")
    values = load_yaml(Path(config)) if config else {}
    values.update(given)
    return values


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML config: keys are flag names with or without dashes, or field names."""
    import yaml

    if not path.is_file():
        raise ArgError(f"--config: {path} is not a file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ArgError(f"--config: {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ArgError(f"--config: {path} must hold a mapping of argument names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        flag = SPELLINGS.get("--" + str(key).replace("_", "-")) or FLAGS.get(str(key))
        if flag is None:
            raise ArgError(f"--config: unknown key {key!r} in {path}")
        if flag.dest == "config":
            raise ArgError(f"--config: {path} cannot name another config file")
        if flag.dest in out:
            raise ArgError(f"--config: {path} sets {flag.name} twice (key {key!r})")
        out[flag.dest] = value
    return out


def _coerce(flag: Flag, value: Any) -> Any:
    """Check a Python/YAML value against the flag's type; lists become tuples."""
    if value is None:
        return None
    want = flag.element_type
    if flag.is_list:
        items = list(value) if isinstance(value, list | tuple) else [value]
        return tuple(_scalar(flag, want, v) for v in items)
    return _scalar(flag, want, value)


def _scalar(flag: Flag, want: type, value: Any) -> Any:
    if want is bool:
        if isinstance(value, bool):
            return value
    elif want is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, str):
        return value
    elif isinstance(value, dict | list):  # JSON-valued string flags given as YAML mappings
        import json

        return json.dumps(value)
    raise ArgError(f"{flag.name}: expected {flag.type}, got {value!r}")


def add_cli_args(parser: argparse.ArgumentParser, stages: Sequence[Stage] = ()) -> None:
    """Add every flag (or those of `stages`) to `parser`, one help group per section."""
    for section in SECTIONS:
        flags = [f for f in section.flags if not stages or f.stage in stages]
        if not flags:
            continue
        group = parser.add_argument_group(section.title)
        for f in flags:
            group.add_argument(*f.flags, **_argparse_kwargs(f))


def _argparse_kwargs(f: Flag) -> dict[str, Any]:
    shown = "" if f.default in (None, False) else f" (default: {f.default})"
    status = "" if f.status.implemented and not f.choice_status else f" [{f.status_label}]"
    kwargs: dict[str, Any] = {"dest": f.dest, "help": f"{f.help}{shown}{status} [{f.stage}]"}
    if f.type == "bool":
        kwargs["action"] = "store_true"
        return kwargs
    kwargs["type"] = f.element_type
    if f.is_list:
        kwargs["nargs"] = "+"
    if f.choices:
        kwargs["choices"] = f.choices
        kwargs["metavar"] = "{" + ",".join(map(str, f.choices)) + "}"
    return kwargs
