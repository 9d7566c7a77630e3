"""Reading checkpoint tensors by name: safetensors (single or sharded), pt, GGUF, or dummy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from kiln.compiler.int4_ckpt import (
    PARTS,
    Int4CheckpointError,
    Int4Config,
    Int4Weight,
    runs,
    shape_of,
    unpack,
)
from kiln.core.quant import (
    GGUF_FORMATS,
    dequantize,
    dequantize_mxfp4,
    from_gguf_blocks,
    quantize,
    widen,
    widest,
)

if TYPE_CHECKING:
    from kiln.compiler.gguf_import import GGUFFile

from kiln.compiler.ckpt_files import (
    LOAD_FORMATS,
    CheckpointError,
    find_gguf,
    resolve_format,
    weight_files,
)

__all__ = ["LOAD_FORMATS", "CheckpointError", "CheckpointReader"]


class CheckpointReader:
    """Name -> tensor over the checkpoint's weight files, opened lazily (memory-mapped)."""

    def __init__(self, path: Path, load_format: str = "auto") -> None:
        self.path = path
        self.load_format = resolve_format(path, load_format)
        self._where: dict[str, Path] = {}
        self._borrowed: dict[str, tuple[CheckpointReader, str]] = {}
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}
        self.files, weight_map = weight_files(path, self.load_format)
        self.gguf: GGUFFile | None = None
        if self.load_format == "gguf":
            from kiln.compiler.gguf_import import GGUFFile

            gguf = find_gguf(path)
            assert gguf is not None  # resolve_format found it
            self.gguf = GGUFFile(gguf)
        elif weight_map is not None:
            self._where = {k: path / f for k, f in weight_map.items()}
        else:
            for f in self.files:
                for name in self._names(f):
                    self._where[name] = f
        # A multimodal checkpoint's language model (Gemma3ForConditionalGeneration): its
        # weights under the names the text model reads; the vision tower is not read.
        self._key: dict[str, str] = {}  # name the model reads -> name in the file
        for key in list(self._where):
            alias = _text_model_name(key)
            if alias is not None and alias not in self._where:
                self._where[alias], self._key[alias] = self._where[key], key
        # A GPTQ / AWQ checkpoint: each packed linear P.qweight (+ qzeros, scales, g_idx)
        # stands for the weight P.weight the model reads.
        self.int4: Int4Config | None = None
        self._int4: dict[str, str] = {}  # P.weight -> P
        self._stored: dict[str, tuple[str, int]] | None = None
        if self.gguf is None and self.load_format != "dummy" and path.is_dir():
            try:
                self.int4 = Int4Config.of_checkpoint(path)
            except Int4CheckpointError as e:
                raise CheckpointError(str(e)) from None
        # GPT-OSS's MXFP4 experts: P_blocks and P_scales stand for the [experts, in, out]
        # tensor P the model reads, dequantized at compile time.
        self.mxfp4 = {
            name[: -len("_blocks")]
            for name in self._where
            if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in self._where
        }
        if self.int4 is not None:
            for name in self._where:
                if name.endswith(".qweight"):
                    prefix = name[: -len(".qweight")]
                    self._int4[prefix + ".weight"] = prefix

    def strip_prefix(self, prefix: str) -> None:
        """Read a tensor stored as `prefix + name` by `name` too (an EAGLE head's weights,
        which some heads store under `model.`)."""
        self.rename_prefix(prefix, "")

    def rename_prefix(self, prefix: str, to: str) -> None:
        """Read a tensor stored as `prefix + name` by `to + name` too (a model's MTP layer,
        model.layers.<L>., as its own head's)."""
        for key in list(self._where):
            new = to + key[len(prefix) :]
            if key.startswith(prefix) and new not in self._where:
                self._where[new], self._key[new] = self._where[key], self._key.get(key, key)

    def borrow(self, name: str, other: CheckpointReader, as_name: str) -> None:
        """Read `name` from `other`'s `as_name` (an EAGLE head's embedding and lm_head are
        its model's; the model's graph holds EAGLE-3's fc, from the head)."""
        self._borrowed[name] = (other, as_name)

    def has(self, name: str) -> bool:
        if name in self._borrowed:
            return True
        if self.gguf is not None:
            return bool(self.gguf.has(name))
        return name in self._where or name in self._int4 or name in self.mxfp4

    def _names(self, f: Path) -> list[str]:
        # A safetensors handle and a loaded pt state dict both answer keys().
        return list(self._handle(f).keys())

    def _handle(self, f: Path) -> Any:
        h = self._open.get(f)
        if h is None:
            try:
                if self.load_format == "safetensors":
                    h = self._stack.enter_context(safe_open(str(f), framework="pt"))
                else:
                    h = _torch_load(f)
            except Exception as e:
                raise CheckpointError(f"cannot read {f.name}: {e}") from e
            self._open[f] = h
        return h

    def names(self) -> list[str]:
        if self.gguf is not None:
            return sorted(self.gguf.tensors)
        return sorted({*self._where, *self._int4, *self.mxfp4, *self._borrowed})

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name in self._borrowed:
            other, as_name = self._borrowed[name]
            return other.get(as_name, shape)
        if self.load_format == "dummy":
            return _dummy(name, shape)
        if self.gguf is not None:
            if not self.gguf.has(name):
                raise CheckpointError(f"{self.gguf.path.name} has no tensor for {name!r}")
            t = torch.from_numpy(self.gguf.get(name).copy())
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {tuple(shape)}"
                )
            return t
        # A GPTQ / AWQ weight is read as floats too, an MXFP4 one as well.
        if name in self.mxfp4:
            blocks, scales = self._raw(name + "_blocks"), self._raw(name + "_scales")
            t = dequantize_mxfp4(blocks, scales).transpose(-1, -2)
        else:
            t = self._int4_weight(name).dequantize() if name in self._int4 else self._raw(name)
        if t.dtype == torch.float8_e4m3fn:  # an fp8 checkpoint's weight, read as floats
            codes, scales = self._fp8(name)
            t = dequantize(codes, scales, "fp8_e4m3")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {tuple(shape)}"
            )
        return t

    def stored_formats(self) -> dict[str, tuple[str, int]]:
        """Checkpoint tensors already in a kiln format, as stored: name -> (format, group).
        GGUF Q8_0 / Q4_0 / Q4_1 blocks, and fp8 e4m3 weights of a checkpoint whose config
        says `quant_method: fp8` (a scale per 128 x 128 block, `weight_scale_inv`, or per
        tensor or row, `weight_scale`); GPTQ / AWQ weights whose groups are runs of inputs
        (not GPTQ's act-order ones: those are read as floats)."""
        if self.gguf is not None:
            types = {n: GGUF_FORMATS.get(self.gguf.qtype(n)) for n in self.gguf.tensors}
            return {n: f for n, f in types.items() if f is not None}
        if self.int4 is not None:
            if self._stored is None:
                self._stored = {}
                for name, prefix in self._int4.items():
                    k = self._shape(name)[1]
                    groups = self._shape(prefix + ".scales")[0]
                    has_g_idx = prefix + ".g_idx" in self._where
                    if k % groups == 0 and (
                        not has_g_idx or runs(self._raw(prefix + ".g_idx"), k // groups)
                    ):
                        self._stored[name] = ("uint4", k // groups)
            return self._stored
        block = self.fp8_block()
        if block is None:
            return {}
        out = {}
        for name in self._where:
            if name.endswith(".weight") and self._dtype(name) == "F8_E4M3":
                k = self._shape(name)[1]
                group = block[1] if block else k
                if k % group == 0:
                    out[name] = ("fp8_e4m3", group)
        return out

    def fp8_block(self) -> tuple[int, ...] | None:
        """An fp8 checkpoint's weight_block_size; () (falsy) for per-tensor or per-row
        scales; None when the checkpoint is not fp8."""
        config = self.path / "config.json"
        if not config.is_file():
            return None
        q = json.loads(config.read_text()).get("quantization_config") or {}
        if q.get("quant_method") != "fp8":
            return None
        block = q.get("weight_block_size")
        return (int(block[0]), int(block[1])) if block else ()

    def _fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as uint8 [N, K], scales [N, K / group, 1]) of a stored fp8 weight."""
        q = self._raw(name)
        n, k = q.shape
        block = self.fp8_block()
        if block:
            bn, bk = block
            inv = self._raw(name + "_scale_inv").float()  # [ceil(N / bn), ceil(K / bk)]
            rows = inv.repeat_interleave(bn, dim=0)[:n]
            return q.view(torch.uint8), rows[:, : k // bk].reshape(n, k // bk, 1).contiguous()
        s = self._raw(name + "_scale").float().reshape(-1)
        s = s.expand(n) if s.numel() == 1 else s
        return q.view(torch.uint8), s.reshape(n, 1, 1).contiguous()

    def quantized(self, name: str, fmt: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of checkpoint tensor `name` in `fmt` (kiln/core/quant.py): tensors
        stored in that format (`stored_formats`) as they are, anything else quantized."""
        stored = GGUF_FORMATS.get(self.gguf.qtype(name)) if self.gguf is not None else None
        if stored is not None and stored[1] == group and widest({stored[0], fmt}) == fmt:
            assert self.gguf is not None
            n, k = self.gguf.shape(name)
            codes, scales = from_gguf_blocks(self.gguf.raw(name), self.gguf.qtype(name), n, k)
            codes, scales = widen(codes, scales, stored[0], fmt)
            return torch.from_numpy(codes), torch.from_numpy(scales)
        if self.gguf is None and self.stored_formats().get(name) == (fmt, group):
            return self._int4_weight(name).kiln_uint4() if self.int4 else self._fp8(name)
        t = self.get(name, self.gguf.shape(name) if self.gguf else self._shape(name))
        return quantize(t, fmt, group)

    def int4_weights(self) -> list[str]:
        """The weights (P.weight) a GPTQ / AWQ checkpoint stores packed."""
        return sorted(self._int4)

    def _int4_weight(self, name: str) -> Int4Weight:
        """The unpacked parts of GPTQ / AWQ weight `name` (P.weight)."""
        assert self.int4 is not None
        prefix = self._int4[name]
        names = {p: f"{prefix}.{p}" for p in PARTS}
        parts = {p: self._raw(x) for p, x in names.items() if x in self._where}
        try:
            return unpack(self.int4, parts, prefix)
        except Int4CheckpointError as e:
            raise CheckpointError(str(e)) from None

    def _raw(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        h = self._handle(f)
        key = self._key.get(name, name)
        return h.get_tensor(key) if self.load_format == "safetensors" else h[key]

    def _dtype(self, name: str) -> str:
        f = self._where[name]
        h = self._handle(f)
        key = self._key.get(name, name)
        if self.load_format == "safetensors":
            return str(h.get_slice(key).get_dtype())
        return "F8_E4M3" if h[key].dtype == torch.float8_e4m3fn else str(h[key].dtype)

    def _shape(self, name: str) -> tuple[int, ...]:
        if name in self._int4:
            assert self.int4 is not None
            return shape_of(self.int4, self._shape(self._int4[name] + ".qweight"))
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        h = self._handle(f)
        key = self._key.get(name, name)
        if self.load_format == "safetensors":
            return tuple(h.get_slice(key).get_shape())
        return tuple(h[key].shape)

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iter_files(self) -> Iterator[Path]:
        yield from self.files


def _torch_load(f: Path) -> Any:
    # weights_only: a checkpoint must never run code on load. mmap needs the zip format;
    # legacy pickles are read whole.
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(f, map_location="cpu", weights_only=True)


def _dummy(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    # Deterministic per name, so a dummy compile is reproducible and cacheable.
    g = torch.Generator().manual_seed(int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "little"))
    if len(shape) == 1:  # norms and biases: near 1 and near 0 keep activations sane
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return base + 0.02 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g)


# Where multimodal checkpoints keep their language model: transformers 4's layout, then 5's.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."))
_TEXT_HEADS = ("language_model.lm_head.weight",)


def _text_model_name(key: str) -> str | None:
    """The text model's name of a multimodal checkpoint's tensor, or None."""
    for prefix, becomes in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return becomes + key[len(prefix) :]
    return "lm_head.weight" if key in _TEXT_HEADS else None
