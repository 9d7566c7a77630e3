"""/update_weights_from_disk (SGLang's): serve another checkpoint's weights without a
restart.

The checkpoint is compiled with the served artefact's own compile arguments (its manifest's
`compile_args`, for the target it was compiled for) by `kiln compile` in a child process,
through the compile cache; the engine then copies the new artefact's weights into place
(runtime/weight_update.py), refusing a checkpoint that compiles to another program. As in
SGLang, requests in flight finish on the old weights (or, with `abort_all_requests`, end at
once) while new ones wait, and none runs across the change; the prefix cache is dropped.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kiln.args import FLAGS
from kiln.serve.streams import ApiError

# Compile arguments that name inputs of the old compile, not properties of the program.
_INPUTS = ("model_path", "tokenizer_path", "revision")


def update_args(manifest: dict[str, Any], model_path: str, load_format: str | None) -> dict:
    """The `kiln compile` arguments (flag names as keys) that compile `model_path` as the
    served artefact was compiled."""
    given = manifest["compile_args"]
    if (manifest["runtime"].get("speculative") or {}).get("draft"):
        raise ApiError(400, "model_path: the artefact carries a draft model or an EAGLE head "
                       "(speculative decoding's draft/), which a weight update does not "
                       "reload")  # fmt: skip
    values = {k: v for k, v in given.items() if k in FLAGS and v != FLAGS[k].default}
    for name in _INPUTS:
        values.pop(name, None)
    values["model_path"] = model_path
    values["target_isa"] = manifest["target"]["isa"]  # where it runs, whatever `native` was
    if load_format is not None:
        values["load_format"] = load_format
    return {FLAGS[k].name.lstrip("-"): v for k, v in values.items()}


async def compile_update(
    manifest: dict[str, Any], model_path: str, load_format: str | None
) -> Path:
    """Compile `model_path` as the artefact of `manifest` was, into a new folder (the caller
    removes its parent when done); a 400 with `kiln compile`'s own one-line error if it
    fails."""
    import yaml

    values = update_args(manifest, model_path, load_format)
    folder = Path(tempfile.mkdtemp(prefix="kiln-update-"))
    config = folder / "compile.yaml"
    config.write_text(yaml.safe_dump(values))
    argv = [
        sys.executable,
        "-m",
        "kiln",
        "compile",
        "--config",
        str(config),
        "-o",
        str(folder / "art"),
    ]
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise ApiError(400, f"model_path: {(lines or ['kiln compile failed'])[-1][:500]}")
    return folder / "art"
