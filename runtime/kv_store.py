"""The prefix cache's disk tier (`--enable-hierarchical-cache --hicache-storage-backend
file`, SGLang's HiCache file storage): the prefix cache's K/V kept as files, found again
by their tokens once the pool has evicted them, or after a restart.

The unit is a block of BLOCK_TOKENS tokens (whole pool pages: a page of 1 token, SGLang's
default, would make a file a token), one file each. A block's name is a chain of digests:
the first block's from the model's identity (every artefact file's checksum, the KV
layout) and the prefix tree's name (a request's cache key), each next one from the one
before and its block's tokens. A name so stands for the whole prefix up to its block, as a
radix tree's path does, and another model's, another layout's or another tenant's blocks
never match. An adapter's requests (their K/V are not the base model's, and a slot says
nothing across restarts) keep to the pool.

Blocks are written by a background thread, each file whole or not at all (a temporary file
renamed into place). One that is missing, short, or names another block when read is a
miss: the request computes it instead. A block read back goes straight into K/V a request
attends over, so the folder must be this user's own: created 0700, and one owned by another
user or writable by others is refused. It is bounded: past its capacity the files least
recently written or read go first (their times carry that order across restarts).

CPU pools only (the pool is host memory there: the tier below it is the disk), one rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import shutil
import stat
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.args import ArgError
from kiln.args.validate import hicache_extra_config
from kiln.runtime.kv_cache import KVCache

log = logging.getLogger("kiln.runtime")

MAGIC = b"KILNKV01"
_HEADER = struct.Struct("<8s32sQ")  # magic, the block's name, payload bytes
_SUFFIX = ".kv"
# The most buffers one readv takes (Linux's IOV_MAX).
_IOV_MAX = 1024
# Tokens a block holds, at least (whole pages).
BLOCK_TOKENS = 64
# Blocks copied out and not yet on disk, at most: past it new ones are not kept (a disk
# slower than the prefills; counted in `dropped`).
MAX_PENDING_BYTES = 256 << 20
# The folder: SGLang's variable names it, else SGLang's default.
FOLDER_VARIABLE = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_FOLDER = "/tmp/hicache"
# A temporary file older than this at start is a stopped server's unfinished write.
STALE_WRITE_S = 600
# The default capacity: this much, or half the disk's free space at start if less.
DEFAULT_CAPACITY = 16 << 30


def check_tier(args: Any, device: str, tp_size: int) -> None:
    """Refuse what the tier cannot serve, before an engine starts its ranks or pool."""
    if not args.enable_hierarchical_cache:  # a backend without it: refused by kiln/args
        return
    if device != "cpu":
        raise ArgError(
            "--enable-hierarchical-cache: kiln has it for CPU KV pools only (a GPU's host "
            "memory tier is planned)"
        )
    if args.hicache_storage_backend is not None and tp_size > 1:
        raise ArgError(
            f"--hicache-storage-backend file: one rank only (this artefact has --tp-size "
            f"{tp_size}); tensor-parallel ranks' blocks are planned"
        )


def open_store(args: Any, art: Any, kv: KVCache) -> KVStore | None:
    """The disk tier the server arguments ask for (`check_tier` passed), or None.
    `--enable-hierarchical-cache` alone adds nothing on a CPU: the pool is host memory,
    SGLang's second tier."""
    if not args.enable_hierarchical_cache:
        return None
    if args.hicache_storage_backend is None:
        log.info("--enable-hierarchical-cache: the KV pool is host memory already; no tier below")
        return None
    extra = hicache_extra_config(args.hicache_storage_backend_extra_config)
    folder = extra.get("storage_dir") or os.environ.get(FOLDER_VARIABLE) or DEFAULT_FOLDER
    capacity = extra.get("capacity_gb")
    page_size = art.spec.page_size
    store = KVStore(
        folder,
        identity(art.manifest["files"], kv, page_size),
        kv,
        page_size,
        None if capacity is None else int(capacity * (1 << 30)),
    )
    log.info(
        "KV blocks of %d tokens kept in %s (%d there from before, up to %.1f GB, %s)",
        store.block_tokens, store.folder, store.stored_blocks, store.capacity / 1e9,
        args.hicache_write_policy,
    )  # fmt: skip
    return store


class StoreError(ValueError):
    """The storage folder cannot be used (the message names it and the flag)."""


def identity(files: dict[str, Any], kv: KVCache, page_size: int) -> bytes:
    """What a block's K/V depend on besides its tokens: the artefact's files (weights, graph,
    kernels: each by its checksum) and the pool's layout (not its size: that follows the
    memory free at start)."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(files):  # each file's manifest entry: its checksum and size
        h.update(f"{name}\0{json.dumps(files[name], sort_keys=True)}\0".encode())
    layers, heads, _, dim = kv.shape
    h.update(f"{layers} {heads} {dim} {kv.v_shape[3]} {kv.dtype} {page_size}".encode())
    return h.digest()


def space_bytes(space: Any) -> bytes | None:
    """A prefix tree's name as bytes; None for an adapter's (not stored)."""
    if space is None:
        return b"\0"
    if isinstance(space, str):
        return b"\1" + space.encode()
    return None


class KVStore:
    def __init__(
        self,
        folder: str | Path,
        model: bytes,
        kv: KVCache,
        page_size: int,
        capacity: int | None = None,
    ) -> None:
        """`capacity`: bytes at most in the folder (None: DEFAULT_CAPACITY, or half the
        disk's free space if less)."""
        if kv.k_host is None or kv.v_host is None:
            raise StoreError("--hicache-storage-backend file keeps a CPU KV pool's pages only")
        self.kv, self.page = kv, page_size
        self.block_pages = max(1, -(-BLOCK_TOKENS // page_size))
        self.block_tokens = self.block_pages * page_size
        layers, heads, _, dim = kv.shape
        # a block's K and V, as its file holds them (all of K, then all of V)
        self._k_block = (layers, heads, self.block_tokens, dim)
        self._v_block = (layers, heads, self.block_tokens, kv.v_shape[3])
        self._k_bytes = math.prod(self._k_block) * kv.itemsize
        self.block_bytes = self._k_bytes + math.prod(self._v_block) * kv.itemsize
        self.model = model
        self.root = _own_folder(Path(folder))
        self.folder = _own_folder(self.root / model.hex()[:32])
        if capacity is None:
            capacity = min(DEFAULT_CAPACITY, shutil.disk_usage(self.folder).free // 2)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._pending: set[bytes] = set()
        self._pending_bytes = 0
        # blocks read back, written, not kept (the writer behind), removed past the capacity
        self.hits = self.written = self.dropped = self.evicted = 0
        self.failed = 0  # blocks the disk refused
        self.off = False  # no more reads or writes (new weights whose folder failed)
        self._closed = False
        self.read_seconds = 0.0  # in `load`
        self._scan()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kiln-kv-store", daemon=True)
        self._writer.start()

    # -- names -----------------------------------------------------------------------------
    def names(self, tokens: Sequence[int], space: Any, known: list[bytes]) -> list[bytes] | None:
        """The names of `tokens`' whole blocks in tree `space`, extending `known` (the names
        of its first blocks, computed before) in place; None for a tree not stored. Names
        computed under another model identity (before new weights) are computed again."""
        tag = space_bytes(space)
        if tag is None:
            return None
        size = self.block_tokens
        if known and len(tokens) >= size and known[0] != self._name(b"", tag, tokens[:size]):
            known.clear()
        for i in range(len(known), len(tokens) // size):
            prev = known[-1] if known else b""
            known.append(self._name(prev, tag, tokens[i * size : (i + 1) * size]))
        return known

    def _name(self, prev: bytes, tag: bytes, block: Sequence[int]) -> bytes:
        """A block's name from the one before it (b"": the first block of tree `tag`)."""
        return _digest((prev or _digest(self.model + tag)) + array("i", block).tobytes())

    def stored(self, names: Sequence[bytes]) -> int:
        """How many of `names`, from the first, are on disk."""
        if self.off:
            return 0
        with self._lock:
            n = 0
            while n < len(names) and names[n] in self._files:
                n += 1
            return n

    # -- blocks in and out -----------------------------------------------------------------
    def load(self, names: Sequence[bytes], pages: Sequence[int]) -> int:
        """Read blocks `names` into pool pages `pages` (block_pages a block), in order,
        stopping at the first that cannot be read (gone, short, another block's); returns
        how many blocks were read."""
        assert len(pages) == len(names) * self.block_pages
        t0 = time.perf_counter()
        n = 0
        for name in names:
            if not self._read(name, pages[n * self.block_pages : (n + 1) * self.block_pages]):
                with self._lock:
                    self._files.pop(name, None)
                break
            with self._lock:
                if name in self._files:
                    self._files.move_to_end(name)
            n += 1
        self.hits += n
        self.read_seconds += time.perf_counter() - t0
        return n

    def save(self, names: Sequence[bytes], pages: Sequence[int]) -> None:
        """Keep blocks `names`, held by pool pages `pages` (block_pages a block): copied out
        now, written by the store's thread. Blocks already kept or on the way are skipped."""
        assert len(pages) == len(names) * self.block_pages
        if self.off or self._closed:
            return
        each = self.block_pages
        with self._lock:
            new = [
                (name, pages[i * each : (i + 1) * each])
                for i, name in enumerate(names)
                if name not in self._files and name not in self._pending
            ]
            room = max(0, (MAX_PENDING_BYTES - self._pending_bytes) // self.block_bytes)
            self.dropped += max(0, len(new) - room)
            new = new[:room]
            self._pending.update(name for name, _ in new)
            self._pending_bytes += len(new) * self.block_bytes
        for name, block in new:
            self._queue.put((name, self._gather(block)))

    def clear(self) -> int:
        """Remove every stored block of this model (SGLang's /clear_hicache_storage_backend);
        returns how many."""
        self.flush()
        with self._lock:
            names, self._files = list(self._files), OrderedDict()
        for name in names:
            _unlink(self._path(name))
        return len(names)

    def rebind(self, files: dict[str, Any]) -> None:
        """Serve the blocks of the artefact whose manifest lists `files` from now on (new
        weights): the blocks on the way are written first, and those of the old weights
        never match again."""
        model = identity(files, self.kv, self.page)
        self.flush()
        with self._lock:
            self.model = model
            self._files = OrderedDict()
        try:
            self.folder = _own_folder(self.root / model.hex()[:32])
        except StoreError as e:  # the old weights' blocks must not be read: the tier stops
            self.off = True
            log.error("the KV disk tier is off until a restart: %s", e)
            return
        self._scan()

    def flush(self) -> None:
        """Wait until every block handed to `save` is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write the blocks on the way and stop the writer (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()

    @property
    def stored_blocks(self) -> int:
        return len(self._files)

    def stats(self) -> dict[str, Any]:
        """What /get_server_info reports of the tier."""
        return {
            "folder": str(self.folder),
            "capacity_bytes": self.capacity,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "stored_blocks": self.stored_blocks,
            "blocks_read": self.hits,
            "read_seconds": round(self.read_seconds, 6),
            "blocks_written": self.written,
            "blocks_not_kept": self.dropped,
            "blocks_removed": self.evicted,
            "blocks_failed": self.failed,
        }

    # -- the pool's memory -----------------------------------------------------------------
    def _slots(self, pages: Sequence[int]) -> slice | np.ndarray:
        """The pool slots of `pages`, in order: a slice when they are consecutive."""
        first, size = pages[0], self.page
        if list(pages) == list(range(first, first + len(pages))):
            return slice(first * size, (first + len(pages)) * size)
        return (np.asarray(pages)[:, None] * size + np.arange(size)).reshape(-1)

    def _gather(self, pages: Sequence[int]) -> bytes:
        """A block's payload: K of its slots for every layer and head, then V."""
        kv, at = self.kv, self._slots(pages)
        assert kv.k_host is not None and kv.v_host is not None
        return kv.k_host[:, :, at].tobytes() + kv.v_host[:, :, at].tobytes()

    def _fill(self, f: Any, pages: Sequence[int]) -> bool:
        """Read a block's payload from file `f` into pool pages `pages`: straight into the
        pool, one readv for every layer and head's run of slots, when the pages are
        consecutive (the allocator's usual answer); else through a buffer. False when the
        file holds less."""
        kv, at = self.kv, self._slots(pages)
        assert kv.k_host is not None and kv.v_host is not None
        if isinstance(at, slice):
            blocks = [(layer, head) for layer in range(kv.shape[0]) for head in range(kv.shape[1])]
            runs = [kv.k_host[(*lh, at)].data.cast("B") for lh in blocks]
            runs += [kv.v_host[(*lh, at)].data.cast("B") for lh in blocks]
            got = 0
            while runs:  # a readv may stop short of the whole (a signal, a large request)
                n = os.readv(f.fileno(), runs[:_IOV_MAX])
                if n == 0:
                    return False
                got += n
                while runs and n >= len(runs[0]):
                    n -= len(runs.pop(0))
                if n:
                    runs[0] = runs[0][n:]
            return got == self.block_bytes
        payload = bytearray(self.block_bytes)
        if f.readinto(payload) != len(payload):
            return False
        k, v = payload[: self._k_bytes], payload[self._k_bytes :]
        kv.k_host[:, :, at] = np.frombuffer(k, kv.k_host.dtype).reshape(self._k_block)
        kv.v_host[:, :, at] = np.frombuffer(v, kv.v_host.dtype).reshape(self._v_block)
        return True

    # -- files -----------------------------------------------------------------------------
    def _path(self, name: bytes) -> Path:
        return self.folder / (name.hex() + _SUFFIX)

    def _read(self, name: bytes, pages: Sequence[int]) -> bool:
        """Block `name` into pool pages `pages`; False (the pages' contents undefined) when
        its file is gone, short, longer, or names another block or size."""
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                header = f.read(_HEADER.size)
                if len(header) != _HEADER.size:
                    return False
                magic, stored_name, size = _HEADER.unpack(header)
                if magic != MAGIC or stored_name != name or size != self.block_bytes:
                    return False
                if not self._fill(f, pages) or f.read(1):
                    return False
                with contextlib.suppress(OSError):  # recently read: last to go, restarts too
                    os.utime(f.fileno())
        except OSError:
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:
                log.exception("the KV storage thread failed on a block")
            finally:
                self._queue.task_done()

    def _write(self, name: bytes, payload: bytes) -> None:
        path = self._path(name)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        ok = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, name, len(payload)))
                f.write(payload)
            os.replace(tmp, path)
            ok = True
        except OSError as e:
            # the first failure a warning, the rest counted (a full disk fails every one)
            self.failed += 1
            level = logging.WARNING if self.failed == 1 else logging.DEBUG
            log.log(
                level, "could not keep a KV block in %s: %s (more: blocks_failed)", self.folder, e
            )
            _unlink(tmp)
        gone: list[bytes] = []
        with self._lock:
            self._pending.discard(name)
            self._pending_bytes -= len(payload)
            if ok:
                self._files[name] = None
                self.written += 1
                most = max(1, self.capacity // (self.block_bytes + _HEADER.size))
                while len(self._files) > most:
                    gone.append(self._files.popitem(last=False)[0])
        self.evicted += len(gone)
        for old in gone:
            _unlink(self._path(old))

    def _scan(self) -> None:
        """The blocks a previous server left (oldest first by time written or read)."""
        found = []
        with os.scandir(self.folder) as entries:
            for e in entries:
                if e.name.endswith(".tmp") and e.is_file(follow_symlinks=False):
                    # a write a stopped server left half done (not one another server
                    # over the same folder is making now)
                    with contextlib.suppress(OSError):
                        if e.stat(follow_symlinks=False).st_mtime < time.time() - STALE_WRITE_S:
                            _unlink(Path(e.path))
                    continue
                if not e.name.endswith(_SUFFIX) or not e.is_file(follow_symlinks=False):
                    continue
                try:
                    name = bytes.fromhex(e.name[: -len(_SUFFIX)])
                    found.append((e.stat(follow_symlinks=False).st_mtime, name))
                except (ValueError, OSError):
                    continue
        for _, name in sorted(found):
            if len(name) == 32:
                self._files[name] = None


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _own_folder(path: Path) -> Path:
    """`path`, created 0700 if missing; refused unless it is a folder of this user that no
    one else can write (its blocks are read into the K/V requests attend over)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise StoreError(f"--hicache-storage-backend file: cannot use {path}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"--hicache-storage-backend file: {path} is not a folder")
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreError(
            f"--hicache-storage-backend file: {path} must belong to this user and be "
            "writable by no one else (its blocks become the K/V requests read); "
            "choose another with SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
        )
    return path


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
