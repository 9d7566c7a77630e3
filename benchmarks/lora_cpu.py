"""What a LoRA adapter costs a request: batch-1 decode and prefill through an adapter
against the base model alone, on the real model.

    python benchmarks/lora_cpu.py                       # ranks 8 and 64, Q4_1 and +a8
    python benchmarks/lora_cpu.py --ranks 16 --rounds 7 --modes Q4_1 --dtypes bfloat16

The model is SmolLM2-135M-Instruct's shipped Q4_1 GGUF file (`python -m kiln.example
--fetch smollm2`), compiled as it is and with `--quantize-activations int8`. The adapters
are random PEFT folders of SmolLM2's shapes on all seven projections of every layer (the
widest adapter a user trains), stored in float32 and in bfloat16 (kiln keeps a bfloat16
file's A and B as they are: half the bytes); the engine (its own process, as
decode_cpu.py's) loads them with --lora-paths. Rounds alternate: the base model, then each
adapter, on the same prompt; each figure is the median of the rounds with the spread
(min-max). Requests with and without an adapter run the native step, an adapter's in its
LoRA hooks after each linear (kernels/csrc/kiln_step.h step_lora): the ratio is what a
request pays for its adapter. No peer is measured: llama.cpp's benchmark program takes no
adapter, and its server takes only adapters converted to GGUF from the base checkpoint in
the Hugging Face format, which this benchmark does not have.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import SMOLLM2_135M, KilnProcess, print_table, read_bandwidth_gbs, spread
from safetensors.torch import save_file

MODES = {"Q4_1": {}, "Q4_1 +a8": {"quantize_activations": "int8"}}
DTYPES = {"float32": ("", torch.float32), "bfloat16": ("-bf16", torch.bfloat16)}


def write_adapter(out: Path, rank: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT folder for SmolLM2-135M's shapes: every projection of every layer, rank
    `rank`, random (small) A and B stored in `dtype`."""
    c = SMOLLM2_135M
    h, inter = c["hidden_size"], c["intermediate_size"]
    head = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for module, (rows, cols) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, cols, generator=gen) * 0.01
            b = torch.randn(rows, rank, generator=gen) * 0.01
            tensors[f"{stem}.lora_A.weight"] = a.to(dtype)
            tensors[f"{stem}.lora_B.weight"] = b.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[-1] for m in shapes})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=128, help="context before the decoded tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    shipped = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-lora-"))
    adapters = {
        f"r{r}{DTYPES[d][0]}": write_adapter(work / f"r{r}{d}", r, seed=r, dtype=DTYPES[d][1])
        for r in args.ranks
        for d in args.dtypes
    }
    prompt = list(range(1000, 1000 + args.depth))
    long_prompt = list(range(2000, 2000 + args.prefill_tokens))
    bw = read_bandwidth_gbs()
    rows = []
    for mode in args.modes:
        art = work / f"art-{mode.replace(' ', '')}"
        compile_model(ServerArgs(model_path=str(shipped), **MODES[mode]), art)
        paths = tuple(f"{name}={path}" for name, path in adapters.items())
        kiln = KilnProcess(art, args.threads, lora_paths=paths)
        runs: dict[str | None, list[tuple[float, float]]] = {None: []}
        runs.update({name: [] for name in adapters})
        for lora in runs:  # warm-up: each path's first step
            kiln.decode_rate(prompt, 8, lora)
        for _ in range(args.rounds):
            for lora in runs:
                decode = kiln.decode_rate(prompt, args.decode_tokens, lora)
                prefill = len(long_prompt) / kiln.time(long_prompt, 1, lora)
                runs[lora].append((decode, prefill))
        kiln.close()
        base_decode = statistics.median(d for d, _ in runs[None])
        base_prefill = statistics.median(f for _, f in runs[None])
        for lora, got in runs.items():
            decode, prefill = [d for d, _ in got], [f for _, f in got]
            rows.append(
                f"| {mode} | {lora or 'none (base model)'} | {spread(decode)} | "
                f"{statistics.median(decode) / base_decode:.2f}x | {spread(prefill)} | "
                f"{statistics.median(prefill) / base_prefill:.2f}x |"
            )
    header = ["model", "adapter", "decode tok/s", "vs base", "prefill tok/s", "vs base"]
    title = (
        f"LoRA adapters on SmolLM2-135M-Instruct: batch-1 decode ({args.decode_tokens} "
        f"tokens after {args.depth}) and prefill of {args.prefill_tokens}"
    )
    print_table(title, bw, args.rounds, args.threads, header, rows)


if __name__ == "__main__":
    main()
