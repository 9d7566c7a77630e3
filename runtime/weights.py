"""Host memory without torch: an artefact's weights file read as numpy views, and the
element types kiln keeps in host memory.

`kiln serve` of a CPU artefact whose step is native (runtime/native_step.py) runs its
steps from C through raw addresses, so loading it needs no torch, whose import alone is
2.0-2.4 s of a 3.8 s start on a 2-core Zen 3. The weights file is mapped (private,
copy-on-write: what the executor or a kernel writes stays in this process) and each
weight is a numpy view of its bytes; the torch tensors the Python executor and the
reference kernels take are views of the same memory (`torch_view`), made when something
first asks for them.

The file is untrusted: its header is checked here as the safetensors library checks it
(one JSON object; every entry a known element type, a shape and byte offsets that fit the
file, agree with the shape and neither overlap nor leave a gap), before any view is made.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kiln.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

MAX_HEADER = 100 * 2**20  # bytes of JSON a weights file's header may take


class DType(NamedTuple):
    code: str  # safetensors' name
    storage: type[np.generic]  # numpy's element of the same size (bits as stored)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.storage).itemsize


# kiln's element types (torch's names) as host memory holds them: numpy has no bfloat16
# or fp8, so those are held as their bits and viewed as the type by torch.
DTYPES = {
    "float32": DType("F32", np.float32),
    "float16": DType("F16", np.float16),
    "bfloat16": DType("BF16", np.uint16),
    "float8_e4m3fn": DType("F8_E4M3", np.uint8),
    "float8_e5m2": DType("F8_E5M2", np.uint8),
    "int64": DType("I64", np.int64),
    "int32": DType("I32", np.int32),
    "int8": DType("I8", np.int8),
    "uint8": DType("U8", np.uint8),
}
_BY_CODE = {d.code: name for name, d in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """kiln's name of an element type given by name or as a torch dtype."""
    return str(dtype).removeprefix("torch.")


def torch_view(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor of element type `dtype` over `array`'s memory (no copy); a normal
    tensor even when first asked for inside inference mode (a warm-up), which steps
    outside it could not write."""
    with torch.inference_mode(False):
        t = torch.from_numpy(array)
        want = getattr(torch, dtype)
        return t if t.dtype == want else t.view(want)


class HostWeights(Mapping[str, np.ndarray]):
    """A weights file's tensors by name, each a numpy array over the mapped file (bits as
    stored, `dtype(name)` naming the element type). `fd`: the file, open for reading
    (kiln/core/artefact.py open_member: reached without a symbolic link); closed here.
    `mapped=False` (--weight-loader-disable-mmap): the file is read whole into memory of
    the process's own (anonymous pages, page-aligned as a mapping), so nothing done to
    the file afterwards (rewritten in place, truncated, its disk gone) reaches the
    weights served, at the cost of the whole file in memory from the start."""

    def __init__(self, fd: int, mapped: bool = True) -> None:
        with os.fdopen(fd, "rb", closefd=True) as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ValueError(f"{size} bytes: too short for a header")
            if mapped:
                self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            else:
                self._map = mmap.mmap(-1, size)
                f.seek(0)
                got, buf = 0, memoryview(self._map)
                while got < size:
                    n = f.readinto(buf[got:])
                    if not n:
                        raise ValueError(f"{got} of {size} bytes: the file ended early")
                    got += n
                buf.release()
        image = np.frombuffer(self._map, np.uint8)
        entries = _header(image)
        start = 8 + int(image[:8].view("<u8")[0])
        self._dtypes: dict[str, str] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._others: list[HostWeights] = []  # whose weights it adopted
        for name, (dtype, shape, begin, end) in entries.items():
            storage = DTYPES[dtype].storage
            view = image[start + begin : start + end].view(storage)
            self._arrays[name] = view.reshape(shape)
            self._dtypes[name] = dtype

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def adopt(self, name: str, other: HostWeights) -> None:
        """Serve `other`'s weight `name` as one of these (an EAGLE head's embedding and
        lm_head are its model's: one copy in memory), keeping `other`'s mapping alive."""
        self._arrays[name], self._dtypes[name] = other[name], other.dtype(name)
        self._others.append(other)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight as a torch tensor over the same memory."""
        return {n: torch_view(a, self._dtypes[n]) for n, a in self._arrays.items()}


def _header(image: np.ndarray) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """The file's entries, checked: name -> (dtype, shape, begin, end) within the data."""
    length = int(image[:8].view("<u8")[0])
    if length > min(MAX_HEADER, len(image) - 8):
        raise ValueError(f"a header of {length} bytes in a file of {len(image)}")
    try:
        header = json.loads(image[8 : 8 + length].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    data = len(image) - 8 - length
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{name!r}: an entry is dtype, shape and data_offsets")
        dtype = _BY_CODE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{name!r}: element type {entry['dtype']!r} is not one kiln keeps")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise ValueError(f"{name!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
            raise ValueError(f"{name!r}: data_offsets {offsets!r} are not two offsets")
        begin, end = offsets
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if not begin <= end <= data or end - begin != want:
            raise ValueError(
                f"{name!r}: bytes {begin}..{end} of {data} for a {dtype} tensor of {shape}"
            )
        entries[name] = (dtype, tuple(shape), begin, end)
    at = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin != at:
            raise ValueError(
                f"{name!r} starts at byte {begin}, not {at}: tensors overlap or leave a gap"
            )
        at = end
    if at != data:
        raise ValueError(f"its tensors end at byte {at} of {data}")
    return entries


def _count(x: object) -> bool:
    return type(x) is int and 0 <= x < 2**62
