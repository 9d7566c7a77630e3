"""kiln's GGUF header reader (compiler/gguf_read.py) against the gguf package's reader, the
format's reference: the same fields as Python values and the same tensor bytes, dtypes and
shapes for every value and tensor type the package writes; a malformed file is refused
with the place named."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from kiln.compiler.gguf_read import GGUFReadError, read


def _write(path: Path) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_string("t.empty", "")
    w.add_array("t.tokens", ["<s>", "", "▁the", "日本", "\n"] * 50)
    w.add_array("t.scores", [0.5, -1.25, 3.0])
    w.add_array("t.types", [1, 3, 4])
    w.add_key_value("t.flags", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    w.add_array("t.nested", [[1, 2], [3]])
    for kind, shape in [("F32", (3, 5)), ("F16", (2, 4)), ("I8", (4,)), ("I32", (2, 2))]:
        dtype = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "I32": np.int32}[kind]
        w.add_tensor(f"plain.{kind}", (rng.standard_normal(shape) * 9).astype(dtype))
    for kind in ("Q8_0", "Q4_K", "Q6_K", "BF16"):  # block bytes as they come: only layout
        qt = GGMLQuantizationType[kind]
        block, size = GGML_QUANT_SIZES[qt]
        rows = rng.integers(0, 256, (3, 512 // block * size), dtype=np.uint8)
        w.add_tensor(f"blocks.{kind}", rows, raw_shape=rows.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "every-type.gguf"
    _write(path)
    return path


def test_fields_and_tensors_are_the_gguf_packages(gguf_path: Path) -> None:
    ours, ref = read(gguf_path), GGUFReader(gguf_path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    # An array of arrays keeps its structure here; the package flattens it (its FIXME).
    assert ours.fields["t.nested"] == [[1, 2], [3]]
    assert ref.fields["t.nested"].contents() == [1, 2, 3]
    for key in keys:
        if key == "t.nested":
            continue
        want = ref.fields[key].contents()
        assert ours.fields[key] == want and type(ours.fields[key]) is type(want), key
    assert ours.fields["t.tokens"][3] == "日本" and ours.fields["t.u64"] == 2**63 + 5
    assert len(ours.tensors) == len(ref.tensors) == 8
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_malformed_files_are_refused_with_the_place_named(gguf_path: Path, tmp_path: Path):
    whole = gguf_path.read_bytes()
    cases = {
        "empty": (b"", "empty file"),
        "magic": (b"GGML" + whole[4:], "no GGUF magic"),
        "version": (whole[:4] + struct.pack("<I", 7) + whole[8:], "GGUF version 7"),
        "big-endian": (whole[:4] + struct.pack(">I", 3) + whole[8:], "big-endian"),
        "header": (whole[:40], "truncated|runs past the end"),
        "data": (whole[:-100], "tensor 'blocks.BF16' runs past the end of the file"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFReadError, match=message):
            read(path)


def _header(fields: bytes = b"", n_fields: int = 0, tensors: bytes = b"", n_tensors: int = 0):
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields) + fields + tensors


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_forged_sizes_are_refused_before_any_allocation(tmp_path: Path) -> None:
    # A file's counts and shapes are untrusted: no wrap-around, no deep recursion, no
    # loop or allocation sized by a forged count.
    nested = _s("k") + struct.pack("<I", 9)
    for _ in range(9):
        nested += struct.pack("<IQ", 9, 1)
    f32 = 0  # GGML type F32
    cases = {
        "dims": (
            _header(tensors=_s("t") + struct.pack("<I5QIQ", 5, *[1] * 5, f32, 0), n_tensors=1),
            "has 5 dimensions",
        ),
        "wrap": (
            _header(tensors=_s("t") + struct.pack("<I2QIQ", 2, 2**32, 2**32, f32, 0), n_tensors=1),
            "tensor 't' runs past the end",
        ),
        "nested": (_header(nested, 1), "nested over 8 deep"),
        "string": (_header(struct.pack("<Q", 2**63) + b"key", 1), "runs past the end"),
        "tokens": (_header(_s("k") + struct.pack("<IIQ", 9, 8, 2**62), 1), "truncated|runs past"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFReadError, match=message):
            read(path)
