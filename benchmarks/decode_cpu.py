"""Batch-1 decode and prefill speed on a real model shape, against transformers in the same run.

    python benchmarks/decode_cpu.py                      # SmolLM2-135M shape, fp32
    python benchmarks/decode_cpu.py --config ../shared/model-configs/qwen2.5-0.5b.json

Both engines get random weights of the same shape (only the shape matters for speed) and
the same torch thread count. Decode tok/s excludes the prefill; each figure is repeated
and reported as min / median of the per-run times. The memory-bandwidth limit is the
measured read bandwidth divided by the weight bytes one decode step must read.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
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


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up: first-call allocations and lazy initialisation
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def rate(tokens: int, seconds: list[float]) -> tuple[float, float]:
    """(best, median) tokens per second."""
    return tokens / min(seconds), tokens / statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="a config.json (default: SmolLM2-135M shape)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt before decoding")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    cfg = json.loads(args.config.read_text()) if args.config else SMOLLM2_135M
    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    (work / "ckpt").mkdir()
    (work / "ckpt" / "config.json").write_text(json.dumps(cfg))
    compile_model(
        ServerArgs(model_path=str(work / "ckpt"), load_format="dummy", dtype=args.dtype),
        work / "art",
    )
    ctx = args.prompt_tokens + args.decode_tokens + args.prefill_tokens
    # Repeats reuse one prompt: the prefix cache would serve it from the second run on, so
    # it is off here; this benchmark measures compute.
    engine = Engine(
        work / "art", max_total_tokens=ctx + 16, max_running_requests=1, disable_radix_cache=True
    )
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()

    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
    long_prompt = torch.randint(3, vocab, (args.prefill_tokens,), generator=g).tolist()
    n = args.decode_tokens

    def kiln_gen(ids: list[int], new: int) -> Callable[[], object]:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        return lambda: engine.generate(input_ids=ids, sampling_params=params)

    def hf_gen(ids: list[int], new: int) -> Callable[[], object]:
        x = torch.tensor([ids])
        kw = {"do_sample": False, "max_new_tokens": new, "min_new_tokens": new, "pad_token_id": 0}
        return lambda: hf.generate(x, **kw)

    results = {}
    with torch.inference_mode():
        for name, gen in (("kiln", kiln_gen), ("transformers", hf_gen)):
            first = timed(gen(prompt, 1), args.repeats)
            full = timed(gen(prompt, n), args.repeats)
            decode = [f - statistics.median(first) for f in full]
            prefill = timed(gen(long_prompt, 1), args.repeats)
            results[name] = {
                "decode": rate(n - 1, decode),
                "prefill": rate(args.prefill_tokens, prefill),
            }

    params = sum(p.numel() for p in hf.parameters())  # a tied lm_head counts once
    step_bytes = decode_weight_bytes(cfg, dtype.itemsize)
    bw = read_bandwidth_gbs()
    limit = bw * 1e9 / step_bytes

    k, h = results["kiln"], results["transformers"]
    print(
        f"\n## {cfg.get('architectures', ['?'])[0]} {cfg['hidden_size']}x"
        f"{cfg['num_hidden_layers']} ({params / 1e6:.1f}M params), {args.dtype}"
    )
    print(machine())
    print(
        f"measured read bandwidth {bw:.1f} GB/s; {step_bytes / 1e6:.0f} MB read per decode "
        f"step -> limit {limit:.1f} tok/s\n"
    )
    print("| metric | kiln (best / median) | transformers (best / median) | ratio (median) |")
    print("| --- | --- | --- | --- |")
    for key, label in (
        ("decode", f"decode tok/s (batch 1, {n} tokens)"),
        ("prefill", f"prefill tok/s ({args.prefill_tokens}-token prompt)"),
    ):
        kb, km = k[key]
        hb, hm = h[key]
        print(f"| {label} | {kb:.1f} / {km:.1f} | {hb:.1f} / {hm:.1f} | {km / hm:.2f}x |")
    kb, km = k["decode"]
    print(
        f"\nkiln decode is {km / limit:.0%} of the bandwidth limit (median; best {kb / limit:.0%})."
    )


if __name__ == "__main__":
    main()
