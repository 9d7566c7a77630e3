"""Compile-time arguments at serve time: they must agree with the artefact."""

from __future__ import annotations

from typing import Any

from kiln.args.spec import FLAGS, ArgError

_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _same(dest: str, given: Any, recorded: Any, manifest: dict[str, Any]) -> bool:
    if dest in ("model_path", "tokenizer_path") and isinstance(given, str) and recorded:
        given = given.rstrip("/")  # stored as a folder's name, or a Hub id as given
        return recorded in (given, given.rsplit("/", 1)[-1])
    if dest == "dtype":
        return _DTYPE_ALIASES.get(given, given) in (
            _DTYPE_ALIASES.get(recorded, recorded),
            manifest["runtime"]["dtype"] if given != "auto" else recorded,
        )
    if dest == "device":
        return given in (recorded, manifest["target"]["device"])
    if isinstance(recorded, list):
        recorded = tuple(recorded)
    return bool(given == recorded)


def refuse_compile_time_changes(explicit: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Raise ArgError naming the first compile-time flag given with a value that differs
    from the one the artefact was compiled with."""
    recorded = manifest.get("compile_args", {})
    for dest, value in explicit.items():
        flag = FLAGS.get(dest)
        if flag is None or flag.stage != "compile":
            continue
        was = recorded.get(dest, flag.default)
        if not _same(dest, value, was, manifest):
            raise ArgError(
                f"{flag.name}: {value!r} disagrees with the artefact, compiled with {was!r} "
                "(compile-time argument: recompile to change it)"
            )
