"""Server arguments: SGLang's names, aliases and defaults, in one frozen, validated tree.

`spec.py` lists every flag with its section, stage (compile or runtime) and support status;
`ServerArgs` is built from it once, at the boundary (CLI, YAML, Python keywords).
"""

from kiln.args.flags import COMPILE, RUNTIME, Flag, Section, Stage, Status
from kiln.args.server_args import (
    SECRET_ARGS,
    ServerArgs,
    add_cli_args,
    explicit_values,
    load_yaml,
)
from kiln.args.spec import FLAGS, SECTIONS, SPELLINGS, ArgError, flag_of
from kiln.args.validate import flag_true, json_object, token_buckets

__all__ = [
    "COMPILE",
    "FLAGS",
    "RUNTIME",
    "SECRET_ARGS",
    "SECTIONS",
    "SPELLINGS",
    "ArgError",
    "Flag",
    "Section",
    "ServerArgs",
    "Stage",
    "Status",
    "add_cli_args",
    "explicit_values",
    "flag_of",
    "flag_true",
    "json_object",
    "load_yaml",
    "token_buckets",
]
