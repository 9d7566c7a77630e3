"""The artefact cache: one folder per cache key under `$KILN_CACHE_DIR/artefacts/`.

`compile_cached` is what `kiln compile` runs. It computes the key without torch
(compiler/key.py); a hit returns the entry at once (torch is never imported); a miss takes
the key's lock, so of N compiles of one key one compiles and the others wait and reuse it,
builds the artefact in a staging folder beside the entry and publishes it by rename (a
compile killed mid-way leaves no entry, and its staging folder is swept later). `-o` places
hard links to the entry's files (copies across file systems), published the same way, so
two compiles into one `-o` never leave a mix. A miss is explained against the nearest
entry, factor by factor.

The cache is bounded: after each miss it removes the least recently used entries (a hit
marks its entry used) until the rest fit in `$KILN_CACHE_MAX_SIZE` (default 20G; `none`
keeps everything), never the entry just built. An `-o` copy is hard links or a copy, so it
outlives its entry; a server started from an entry keeps the files it opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.args import ServerArgs
from kiln.compiler.hub import local_paths
from kiln.compiler.key import CompileKey, compile_key
from kiln.compiler.publish import publish, staging_dir, sweep
from kiln.core import artefact as fmt
from kiln.paths import cache_dir

log = logging.getLogger("kiln.compile")

MAX_SIZE_ENV = "KILN_CACHE_MAX_SIZE"
DEFAULT_MAX_SIZE = "20G"
_SIZES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, what: str) -> int:
    """Bytes of a size such as 20G, 500M, 1.5T, 4096 (binary units); `what` names the flag
    or variable in the error."""
    hit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text.strip(), re.IGNORECASE)
    if not hit:
        raise ValueError(f"{what} {text!r}: expected a size such as 20G, 500M or 1T")
    return int(float(hit.group(1)) * _SIZES[hit.group(2).upper()])


def max_cache_setting() -> str:
    """$KILN_CACHE_MAX_SIZE as given, or its default."""
    return os.environ.get(MAX_SIZE_ENV, DEFAULT_MAX_SIZE).strip()


def max_cache_bytes() -> int | None:
    """The cache's bound from $KILN_CACHE_MAX_SIZE (None: `none`, unbounded)."""
    text = max_cache_setting()
    if text.lower() == "none":
        return None
    return parse_size(text, MAX_SIZE_ENV)


@dataclass(frozen=True)
class CompileResult:
    path: Path
    cache_key: str
    cache_hit: bool
    seconds: float
    target: str = ""  # what was compiled for, and in which dtype (said in the CLI's output)
    dtype: str = ""
    miss: tuple[str, ...] = ()  # how the key differs from the nearest entry, on a miss


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    bytes: int
    last_used: float
    manifest: dict[str, Any]

    @property
    def summary(self) -> str:
        m = self.manifest
        t = m["target"]
        return (
            f"{m['runtime']['served_model_name']} {t['device']}/{t['isa']} {m['runtime']['dtype']}"
        )


class Store:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or cache_dir()) / "artefacts"

    def entry(self, key: str) -> Path:
        return self.root / key

    def lookup(self, key: str) -> Path | None:
        """The entry of `key` if it is there and whole (sizes checked, not checksums: those
        are checked when the artefact is loaded); marks it used."""
        path = self.entry(key)
        if not _whole(path, key):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # last used, for gc
        return path

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f".{key}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def entries(self) -> list[Entry]:
        out = []
        for path in sorted(self.root.glob("[0-9a-f]" * 8 + "*")) if self.root.is_dir() else []:
            try:
                manifest = fmt.read_manifest(path)
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                used = path.stat().st_mtime
            except (fmt.ArtefactError, OSError):  # not an entry, or removed while we looked
                continue  # (another compile trimming the cache)
            out.append(Entry(path.name, path, size, used, manifest))
        return out

    def find(self, prefix: str) -> list[Entry]:
        return [e for e in self.entries() if e.key.startswith(prefix)]

    def remove(self, key: str) -> None:
        with self.lock(key):
            shutil.rmtree(self.entry(key), ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.root / f".{key}.lock").unlink()

    def gc(self, max_bytes: int, keep: str | None = None) -> list[Entry]:
        """Remove least recently used entries until the rest fit in `max_bytes`; never the
        entry of `keep`."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.bytes for e in entries)
        removed = []
        for e in entries:
            if total <= max_bytes:
                break
            if e.key == keep:
                continue
            self.remove(e.key)
            total -= e.bytes
            removed.append(e)
        if self.root.is_dir():
            sweep(self.root)
        return removed

    def nearest(self, factors: dict[str, Any]) -> tuple[Entry, list[str]] | None:
        """The entry whose factors differ least from `factors`, with the differences."""
        best: tuple[Entry, list[str]] | None = None
        for e in self.entries():
            diff = explain(e.manifest.get("cache_factors", {}), factors)
            if best is None or len(diff) < len(best[1]):
                best = (e, diff)
        return best


def _whole(path: Path, key: str) -> bool:
    try:
        manifest = fmt.read_manifest(path)
    except fmt.ArtefactError:
        return False
    if manifest["cache_key"] != key:
        return False
    try:
        return all(
            (path / rel).stat().st_size == f["bytes"] for rel, f in manifest["files"].items()
        )
    except OSError:
        return False


# What runs on a miss: the compile driver's `build_artefact(args, key, out)`.
Builder = Callable[[ServerArgs, CompileKey, Path], None]


def compile_cached(
    args: ServerArgs, build: Builder, out: str | Path | None = None, rehash: bool = False
) -> CompileResult:
    """Compile through the cache, calling `build` on a miss; with `out`, also place the
    artefact there. (The driver is passed in, not imported: it loads torch, which a hit
    never needs.)"""
    t0 = time.perf_counter()
    limit = max_cache_bytes()  # a bad value fails before the compile, not after
    args = local_paths(args)  # Hub ids: fetched (compiler/hub.py)
    ck = compile_key(args, rehash=rehash)
    store = Store()
    path = store.lookup(ck.key)
    miss: tuple[str, ...] = ()
    built = False
    if path is None:
        with store.lock(ck.key):
            path = store.lookup(ck.key)  # compiled by another process while we waited
            if path is None:
                near = store.nearest(ck.factors)
                if near is not None:
                    miss = (f"nearest entry {near[0].key[:16]} ({near[0].summary})", *near[1])
                    log.debug("cache miss: %s differs in: %s", miss[0], "; ".join(miss[1:]))
                path = store.entry(ck.key)
                build(args, ck, path)
                built = True
        if limit is not None:
            for e in store.gc(limit, keep=ck.key):
                log.info(
                    "cache over %s=%s: removed %s (%s, %.1f MB, least recently used)",
                    MAX_SIZE_ENV,
                    max_cache_setting(),
                    e.key[:16],
                    e.summary,
                    e.bytes / 1e6,
                )
    if out is not None:
        out = Path(out)
        if not _whole(out, ck.key):
            place(path, out)
        path = out
    seconds = time.perf_counter() - t0
    return CompileResult(path, ck.key, not built, seconds, str(ck.target), ck.dtype, miss)


def place(entry: Path, out: Path) -> None:
    """Publish a copy of `entry` at `out`: hard links where the file system allows."""
    tmp = staging_dir(out)
    try:
        for src in sorted(entry.rglob("*")):
            dst = tmp / src.relative_to(entry)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _show(v: Any) -> str:
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]
    if isinstance(v, dict) and set(v) == {"device", "isa", "features"}:
        return f"{v['device']}/{v['isa']}"
    return json.dumps(v) if not isinstance(v, str) else v


_WORDS = {
    "kiln_source_sha256": "kiln's compiler or kernel source",
    "config_sha256": "the checkpoint's config.json",
    "weights_sha256": "checkpoint weights",
    "tokenizer_sha256": "tokenizer files",
    "native_toolchain": "C compiler",
}


def explain(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Plain-words differences between two sets of cache factors, old -> new."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        name = _WORDS.get(k, k.replace("_", " "))
        if k == "compile_args" and isinstance(a, dict) and isinstance(b, dict):
            out += [
                f"--{f.replace('_', '-')}: {_show(a.get(f))} -> {_show(b.get(f))}"
                for f in sorted(set(a) | set(b))
                if a.get(f) != b.get(f)
            ]
        elif k.endswith("sha256") and isinstance(a, dict) and isinstance(b, dict):
            for f in sorted(set(a) | set(b)):
                if a.get(f) != b.get(f):
                    what = "added" if f not in a else "removed" if f not in b else "changed"
                    out.append(f"{name}: {f} {what}")
        elif k.endswith("sha256"):
            out.append(f"{name} changed")
        else:
            out.append(f"{name}: {_show(a)} -> {_show(b)}")
    return out
