"""Write a GPTQ or AWQ checkpoint from a float Hugging Face checkpoint, laid out as AutoGPTQ /
AutoAWQ publish them (packed int32 qweight and qzeros, float16 scales, GPTQ's g_idx and its
zero-minus-one), with round-to-nearest codes: the format is what kiln reads, so the codes
need not come from the GPTQ / AWQ algorithms. Returns the dequantized weights, which the
tests load into transformers as the oracle. Written from the formats' descriptions, apart
from kiln's reader (compiler/int4_ckpt.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(codes: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """uint codes 0..15 -> int32, 8 codes an int32 along `axis`; bits 4j..4j+3 hold element
    8c + order[j] of that axis."""
    c = np.moveaxis(codes.astype(np.uint32), axis, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    out = np.zeros(c.shape[:-1], dtype=np.uint32)
    for j, src in enumerate(order):
        out |= c[..., src] << np.uint32(4 * j)
    return np.ascontiguousarray(np.moveaxis(out.view(np.int32), -1, axis))


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, v1: bool):
    """Asymmetric 4-bit round-to-nearest per group: codes [N, K], zeros [N, G] (1..15 when
    the zero is stored minus one), fp16 scales [N, G]."""
    n, _ = w.shape
    lo = torch.zeros(n, groups).scatter_reduce(1, g_idx.expand(n, -1), w, "amin")
    hi = torch.zeros(n, groups).scatter_reduce(1, g_idx.expand(n, -1), w, "amax")
    s = ((hi - lo) / 15).clamp_min(1e-8).half().float()
    z = torch.round(-lo / s).clamp(1 if v1 else 0, 15)
    q = torch.round(w / s[:, g_idx] + z[:, g_idx]).clamp(0, 15)
    return q.to(torch.uint8), z.to(torch.uint8), s


def write_int4_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    group: int,
    act_order: bool = False,
    v2: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """`src` as a `method` ("gptq" / "awq") checkpoint at `dst`; every linear of the layers
    packed, embeddings, norms and lm_head as they were. `group` -1: one group per row.
    `act_order`: GPTQ's desc_act, inputs assigned to groups through a permutation."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, dequant = {}, {}
    gen = torch.Generator().manual_seed(seed)
    for name, w in tensors.items():
        if w.dim() != 2 or not name.startswith("model.layers.") or not name.endswith(".weight"):
            out[name] = w
            continue
        prefix, w = name[: -len(".weight")], w.float()
        k = w.shape[1]
        size = k if group == -1 else group
        perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // size
        q, z, s = _rtn(w, g_idx, k // size, v1=method == "gptq" and not v2)
        dequant[name] = s[:, g_idx] * (q.float() - z[:, g_idx].float())
        stored_z = z.numpy() - (1 if method == "gptq" and not v2 else 0)
        if method == "gptq":
            out[prefix + ".qweight"] = torch.from_numpy(_pack(q.t().numpy(), 0))
            out[prefix + ".qzeros"] = torch.from_numpy(_pack(stored_z.T, 1))
            out[prefix + ".g_idx"] = g_idx.to(torch.int32)
        else:
            out[prefix + ".qweight"] = torch.from_numpy(_pack(q.t().numpy(), 1, AWQ_ORDER))
            out[prefix + ".qzeros"] = torch.from_numpy(_pack(stored_z.T, 1, AWQ_ORDER))
        out[prefix + ".scales"] = s.t().contiguous().half()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if method == "gptq":
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": "gptq_v2" if v2 else "gptq",
        }
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}  # fmt: skip
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequant


def hf_folder_from_gguf(gguf: Path, dst: Path) -> Path:
    """A GGUF file as a Hugging Face folder (config, float32 safetensors, tokenizer), by
    kiln's GGUF reader, whose reading test_gguf and test_real_model hold to transformers'
    (and which parses the file once a process, where transformers takes ~20 s on a slow
    core): the float checkpoint a GPTQ / AWQ one is written from."""
    from kiln.compiler.gguf_import import GGUFFile

    f = GGUFFile(gguf)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(f.hf_config()))
    tensors = {name: torch.tensor(f.get(name)) for name in f.tensors}
    save_file(tensors, str(dst / "model.safetensors"))
    f.write_tokenizer(dst)
    return dst
