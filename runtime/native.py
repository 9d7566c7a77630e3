"""Opening an artefact's native kernel library (kernels/cpu_kernels.so).

A shared library is code, and an artefact is untrusted input, so the runtime never loads
the artefact's copy just because its checksum matches (whoever edits a file recomputes
checksums). It loads, in this order:

1. this user's own build with that checksum, from the kiln kernel store ($KILN_CACHE_DIR/
   kernels, where `kiln compile` keeps what it built; a CI cache restores it with the rest);
2. else the artefact's copy, only if the user says so with --trust-remote-code;
3. else nothing: one line names the `kiln compile` that builds the kernels on this machine.

Native code is built at compile time only: loading never runs a C compiler (what the
runtime runs is what the compile decided, built with the toolchain the cache key names).

The library's vector width and panel grouping must match the weights' stored layout.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

from kiln.core import artefact as fmt
from kiln.core.ir import Graph
from kiln.core.layout import lanes_of, panels_of
from kiln.kernels import native

log = logging.getLogger("kiln.runtime")


def open_library(
    root: Path, manifest: dict[str, Any], graph: Graph, trust_remote_code: bool = False
) -> ctypes.CDLL | None:
    """The artefact's kiln_cpu library, loaded; None when the artefact has none."""
    info = manifest.get("native")
    if info is None:
        return None
    path = _trusted_copy(root, manifest, info, trust_remote_code)
    try:
        lib = native.load(path)
    except (OSError, AttributeError, native.KernelBuildError) as e:
        raise fmt.ArtefactError(f"{root}/{info['file']}: cannot load the kernels: {e}") from None
    got = (int(lib.kiln_linear_lanes()), int(lib.kiln_linear_group_panels()))
    if got != (info["lanes"], info["group_panels"]):
        raise fmt.ArtefactError(
            f"{root}: kernels of {got[0]} lanes x {got[1]} panels, the manifest says "
            f"{info['lanes']} x {info['group_panels']}"
        )
    for name, spec in graph.weights.items():
        panels = panels_of(spec.layout)
        if (panels is not None and panels != got) or lanes_of(spec.layout) not in (None, got[0]):
            raise fmt.ArtefactError(
                f"{root}: weight {name!r} is stored as {spec.layout}, the kernels read "
                f"panels{got[0]}x{got[1]}"
            )
    return lib


def _trusted_copy(
    root: Path, manifest: dict[str, Any], info: dict[str, Any], trust_remote_code: bool
) -> Path:
    stored = native.store() / f"cpu_kernels-{info['build_id']}.so"
    if stored.is_file() and fmt.sha256_file(stored) == info["sha256"]:
        return stored
    if trust_remote_code:
        log.warning("loading %s/%s as built elsewhere (--trust-remote-code)", root, info["file"])
        return root / info["file"]
    raise fmt.ArtefactError(
        f"{root}: its kernels ({info['file']}) were not built by kiln on this machine "
        f"(none in {native.store()} has their checksum); compile it here, which builds them: "
        f"{fmt.compile_command(manifest, f'[its flags] -o {root}')}, or pass "
        "--trust-remote-code to load them if you trust where the artefact came from"
    )


def open_step(
    root: Path, manifest: dict[str, Any], trust_remote_code: bool = False
) -> ctypes.CDLL | None:
    """The artefact's native decode step (compiler/lower_step.py), loaded under the kernels'
    rule: this user's own build with the manifest's checksum, else the artefact's copy with
    --trust-remote-code. Unlike the kernels, a step that is not there is not an error: the
    Python executor runs the same graph (one warning says so)."""
    info = manifest.get("native_step")
    if info is None:
        return None
    stored = native.store() / f"step-{info['build_id']}.so"
    if stored.is_file() and fmt.sha256_file(stored) == info["sha256"]:
        path = stored
    elif trust_remote_code:
        log.warning("loading %s/%s as built elsewhere (--trust-remote-code)", root, info["file"])
        path = root / info["file"]
    else:
        log.warning(
            "%s: its native decode step was not built by kiln on this machine (none in %s "
            "has its checksum); decode steps run in the Python executor. Compile it here "
            "for the native step: %s",
            root,
            native.store(),
            fmt.compile_command(manifest, f"[its flags] -o {root}"),
        )
        return None
    try:
        lib = native.load_step(path)
    except (OSError, AttributeError, native.KernelBuildError) as e:
        raise fmt.ArtefactError(f"{root}/{info['file']}: cannot load the step: {e}") from None
    return lib
