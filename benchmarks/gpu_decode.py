"""Decode on a GPU: CUDA-graph replay against eager steps, on a real shape with dummy weights.

    python benchmarks/gpu_decode.py                        # llama-3.2-1b, bf16, batch 1/16/64
    python benchmarks/gpu_decode.py --config qwen2.5-0.5b --batches 1 8 --profile
    python benchmarks/gpu_decode.py --config qwen2.5-0.5b --deterministic

Run by benchmarks/gpu_check.sh on a machine with an NVIDIA GPU (first run 2026-11-26 on an
H100: benchmarks/RESULTS.md, "GPU"). The model is a shape from ../shared/model-configs (or
a config.json path), compiled for the host's GPU (`--device cuda`, `--load-format dummy`: a
step's speed does not depend on the weights' values). Two artefacts: the default plan
(decode replayed from CUDA graphs at SGLang's batch-size buckets) and
`--disable-cuda-graph` (left out with `--graphs-only`; `--deterministic` puts
`--enable-deterministic-inference`'s artefact, CUDA graphs and the batch-invariant kernels,
in its place). For B requests, decode step time is (time of T + 1 tokens - time of 1
token) / T, alternating rounds, median (min-max); the roofline is the GPU's nominal
bandwidth over the weight bytes a step reads. Prefill: one prompt of `--prefill-tokens`
(default 1024; 0 leaves it out), the prefix cache flushed before each, time to its first
token. `--profile`
adds the GPU kernels a decode step of `--profile-batch` requests (default 1) launches, the
GPU's busy time against the wall clock's (the rest is the host's: scheduling, step inputs,
sampling), and the kernels the GPU spends its time in. An 8B shape writes two 16 GB
artefacts first: over 200 s on the H100 machine, so the default is a 1B shape.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent.parent / "shared" / "model-configs"
NOMINAL_GBS = {"H100": 3350.0, "H200": 4800.0}  # HBM3 / HBM3e, the vendor's figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        default="llama-3.2-1b",
        help="a name in ../shared/model-configs, or the path of a config.json",
    )
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument(
        "--profile",
        action="store_true",
        help="then profile decode of each artefact: GPU kernels a step, top kernels",
    )
    p.add_argument(
        "--profile-batch", type=int, default=1, help="the batch --profile decodes (default 1)"
    )
    p.add_argument(
        "--pool-tokens",
        type=int,
        help="KV pool size in tokens (default: what the largest batch needs); a server's "
        "pool is far larger, and a recorded step's page table is as wide as the context",
    )
    p.add_argument(
        "--graphs-only",
        action="store_true",
        help="only the CUDA-graph artefact (no eager column: half the compile and time)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="compare with --enable-deterministic-inference's artefact instead of eager steps",
    )
    p.add_argument("--prefill-tokens", type=int, default=1024)
    args = p.parse_args()

    import torch

    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode: no CUDA device here")
    name = torch.cuda.get_device_name()
    cfg_path = Path(args.config)
    if not cfg_path.is_file():
        cfg_path = CONFIGS / f"{args.config}.json"
    work = Path(tempfile.mkdtemp(prefix="kiln-gpu-"))
    ckpt = work / cfg_path.stem
    ckpt.mkdir()
    shutil.copy(cfg_path, ckpt / "config.json")
    arts = {}
    other = (
        ("deterministic", {"enable_deterministic_inference": True})
        if args.deterministic
        else ("eager", {"disable_cuda_graph": True})
    )
    modes = [("cuda graphs", {}), other]
    for label, extra in modes[:1] if args.graphs_only else modes:
        arts[label] = work / label.replace(" ", "-")
        flags = {"load_format": "dummy", "dtype": "bfloat16", "device": "cuda", **extra}
        compile_model(ServerArgs(model_path=str(ckpt), **flags), arts[label])
    prompt = list(range(100, 132))
    # Two engines share the GPU: each KV pool holds what the largest batch needs, not a
    # fraction of the whole card (the first would leave the second too little).
    tokens = args.pool_tokens or max(
        max(args.batches) * (len(prompt) + args.tokens + 2), args.prefill_tokens + 64
    )
    engines = {}
    for label, art in arts.items():
        t = time.perf_counter()
        engines[label] = Engine(
            art,
            skip_tokenizer_init=True,
            max_running_requests=max(args.batches),
            max_total_tokens=tokens,
        )
        print(f"{label}: started in {time.perf_counter() - t:.1f}s", flush=True)
    weight_bytes = (arts["cuda graphs"] / "weights" / "rank0.safetensors").stat().st_size

    def run(engine: Engine, batch: int, new: int, ids: list[int] = prompt) -> float:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(input_ids=[ids] * batch, sampling_params=params)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    got: dict[tuple[str, int], list[float]] = {}
    for b in args.batches:
        for engine in engines.values():
            run(engine, b, 2)
        for _ in range(args.rounds):
            for label, engine in engines.items():
                first, full = run(engine, b, 1), run(engine, b, args.tokens + 1)
                got.setdefault((label, b), []).append((full - first) / args.tokens * 1e3)
    long = list(range(100, 100 + args.prefill_tokens))
    for engine in engines.values() if long else ():  # a prompt's kernels compiled first
        engine.flush_cache()
        run(engine, 1, 1, long)
    for _ in range(args.rounds if long else 0):
        for label, engine in engines.items():
            engine.flush_cache()
            got.setdefault((label, 0), []).append(run(engine, 1, 1, long) * 1e3)
    bw = next((v for k, v in NOMINAL_GBS.items() if k in name), None)
    floor = weight_bytes / (bw * 1e9) * 1e3 if bw else None
    second = other[0]
    print(f"\n{cfg_path.stem} bf16 on {name}; torch {torch.__version__}")
    print(
        f"| batch | cuda graphs ms/step | {second} ms/step | {second} / graphs "
        "| tok/s (graphs) | roofline |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for b in [*args.batches, *([0] if long else [])]:
        g, e = got[("cuda graphs", b)], got.get((second, b))
        mg = statistics.median(g)
        roof = f"{floor / mg:.0%}" if floor and b else "-"
        me = statistics.median(e) if e else None
        col = f"{me:.2f} ({min(e):.2f}-{max(e):.2f})" if e and me else "-"
        ratio = f"{me / mg:.2f}x" if me else "-"
        rate = (b or len(long)) / mg * 1e3
        what = b or f"prefill of {len(long)} (ms)"
        print(
            f"| {what} | {mg:.2f} ({min(g):.2f}-{max(g):.2f}) | {col}"
            f" | {ratio} | {rate:.0f} | {roof} |"
        )
    print(json.dumps({"weights_gb": weight_bytes / 1e9}))
    if args.profile:
        b = args.profile_batch
        for label, engine in engines.items():
            profile(f"{label}, batch {b}", lambda e=engine: run(e, b, args.tokens + 1), args.tokens)
    shutil.rmtree(work, ignore_errors=True)


def profile(label: str, fn, steps: int) -> None:
    """GPU kernels a decode step and where the GPU time goes (torch.profiler over one
    request's whole generation: a prefill and `steps` decode steps)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = fn()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(
        f"\n{label}: {len(kernels) / (steps + 1):.0f} GPU kernels a step,"
        f" GPU busy {busy:.1f} of {wall * 1e3:.1f} ms"
    )
    print(
        prof.key_averages().table(
            sort_by="device_time_total", row_limit=12, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
