"""Putting an artefact folder in place safely, with other processes doing the same.

An artefact is written into a staging folder beside its destination, then published by
renames, under an exclusive lock on the parent folder (`flock`), so concurrent publishers
to one destination take turns and a reader sees the old artefact, or the new one, or (for
the instant between two renames) none, never a mix. Staging and replaced folders are named
with the pid that made them; a publisher sweeps those whose process is gone (a compile
killed mid-way), so a crash leaves nothing for long. Files get the umask's normal modes
(a staging folder starts private), so a published artefact is readable as any other file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln.core.artefact import MANIFEST, ArtefactError
from kiln.paths import pid_alive

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^/]+")


def staging_dir(out: Path) -> Path:
    """A fresh, private folder beside `out` to write an artefact into."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (blocks until other holders let go)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def publish(staged: Path, out: Path) -> None:
    """Move a finished artefact from `staged` to `out`, replacing an older artefact there;
    refuse to replace a folder that is not an artefact."""
    normalise_modes(staged)
    with locked(out.parent):
        sweep(out.parent)
        if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise ArtefactError(
                f"-o {out}: folder exists and is not a kiln artefact; refusing to overwrite it"
            )
        if not out.exists():
            os.replace(staged, out)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        os.replace(out, old / "art")
        os.replace(staged, out)
        shutil.rmtree(old, ignore_errors=True)


def sweep(folder: Path) -> None:
    """Remove staging and replaced folders left by processes that no longer run."""
    for entry in folder.iterdir():
        hit = _LEFTOVER.fullmatch(entry.name)
        if hit and entry.is_dir() and not pid_alive(int(hit["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normalise_modes(root: Path) -> None:
    """Folders 0777 and files 0666, less the umask: what a plain mkdir and open give."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
