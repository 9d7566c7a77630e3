"""What the benchmarks share: the SmolLM2-135M shape, the machine line, the measured read
bandwidth and the bytes a decode step reads."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def machine() -> str:
    """One line naming what the figures depend on: CPU, widest vector ISA, threads, torch."""
    isa, model = "", platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next(ln for ln in info.splitlines() if ln.startswith("flags")).split()
        model = next(ln for ln in info.splitlines() if ln.startswith("model name"))
        model = model.split(":", 1)[1].strip()
        isa = next((f for f in ("amx_bf16", "avx512f", "avx2") if f in flags), "")
    except (OSError, StopIteration):
        pass
    return (
        f"machine: {model}{f' ({isa})' if isa else ''}, {torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}; date {date.today()}"
    )


def decode_weight_bytes(cfg: dict, itemsize: int) -> int:
    """Bytes of weights one decode step reads: every layer's matrices and norms, the final
    norm and the lm_head (the embedding table itself is only looked up, one row per token,
    so an untied one is not counted)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or hidden // heads
    attn = hidden * d * (2 * heads + 2 * kv_heads)  # q, o, k, v
    mlp = 3 * hidden * cfg["intermediate_size"]
    per_layer = attn + mlp + 2 * hidden
    params = cfg["num_hidden_layers"] * per_layer + hidden + cfg["vocab_size"] * hidden
    return params * itemsize


def read_bandwidth_gbs(mb: int = 1024, repeats: int = 7) -> float:
    """Best observed read bandwidth: summing a large fp32 buffer that misses every cache."""
    x = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


# precision -> llama.cpp ftype its quantizer writes (None: the shipped file as it is); the
# K-quant mixes as `llama-quantize` names them (its mixes keep some matrices in Q5_x / Q8_0
# where a row is not whole 256-weight super-blocks, as SmolLM2's 576 is not).
PRECISIONS = {
    "F32": 0,
    "Q8_0": 7,
    "Q4_0": 2,
    "Q4_1": None,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
}


def gguf_for(precision: str, shipped: Path, work: Path, quantizer: Path | None = None) -> Path:
    """The real model's GGUF file at `precision`, written by llama.cpp's own quantizer from
    the shipped Q4_1 file: the `llama-quantize` program when given (built beside
    llama-server), else llama-cpp-python's binding of it."""
    ftype = PRECISIONS[precision]
    if ftype is None:
        return shipped
    out = work / f"smollm2-{precision}.gguf"
    if out.exists():
        return out
    if quantizer is not None:
        cmd = [str(quantizer), "--allow-requantize", str(shipped), str(out), precision, "2"]
        subprocess.run(cmd, check=True, capture_output=True)
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    if llama_cpp.llama_model_quantize(
        str(shipped).encode(), str(out).encode(), ctypes.byref(params)
    ):
        raise RuntimeError(f"llama.cpp could not write {precision}")
    return out
