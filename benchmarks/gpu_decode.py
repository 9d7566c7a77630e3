"""Decode on a GPU: CUDA-graph replay against eager steps, on a real shape with dummy weights.

    python benchmarks/gpu_decode.py                        # llama-3-8b, bf16, batch 1/16/64
    python benchmarks/gpu_decode.py --config qwen2.5-0.5b --batches 1 8

Run by benchmarks/gpu_check.sh on a machine with an NVIDIA GPU; it has not run yet (no GPU
has been lent to this project so far). The model is a shape from ../shared/model-configs,
compiled for the host's GPU (`--device cuda`, `--load-format dummy`: a step's speed does not
depend on the weights' values). Two artefacts: the default plan (decode replayed from CUDA
graphs at SGLang's batch-size buckets) and `--disable-cuda-graph`. For B requests, decode
step time is (time of T + 1 tokens - time of 1 token) / T, alternating rounds, median
(min-max); the roofline is the GPU's nominal bandwidth over the weight bytes a step reads.
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
    p.add_argument("--config", default="llama-3-8b", help="a name in ../shared/model-configs")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()

    import torch

    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode: no CUDA device here")
    name = torch.cuda.get_device_name()
    cfg_path = CONFIGS / f"{args.config}.json"
    work = Path(tempfile.mkdtemp(prefix="kiln-gpu-"))
    ckpt = work / args.config
    ckpt.mkdir()
    shutil.copy(cfg_path, ckpt / "config.json")
    arts = {}
    for label, extra in (("cuda graphs", {}), ("eager", {"disable_cuda_graph": True})):
        arts[label] = work / label.replace(" ", "-")
        flags = {"load_format": "dummy", "dtype": "bfloat16", "device": "cuda", **extra}
        compile_model(ServerArgs(model_path=str(ckpt), **flags), arts[label])
    engines = {}
    for label, art in arts.items():
        t = time.perf_counter()
        engines[label] = Engine(
            art, skip_tokenizer_init=True, max_running_requests=max(args.batches)
        )
        print(f"{label}: started in {time.perf_counter() - t:.1f}s", flush=True)
    weight_bytes = (arts["eager"] / "weights" / "rank0.safetensors").stat().st_size
    prompt = list(range(100, 132))

    def run(engine: Engine, batch: int, new: int) -> float:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(input_ids=[prompt] * batch, sampling_params=params)
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
    bw = next((v for k, v in NOMINAL_GBS.items() if k in name), None)
    floor = weight_bytes / (bw * 1e9) * 1e3 if bw else None
    print(f"\n{args.config} bf16 on {name}; torch {torch.__version__}")
    print("| batch | cuda graphs ms/step | eager ms/step | speed-up | tok/s (graphs) | roofline |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b in args.batches:
        g, e = got[("cuda graphs", b)], got[("eager", b)]
        mg, me = statistics.median(g), statistics.median(e)
        roof = f"{floor / mg:.0%}" if floor else "n/a"
        print(
            f"| {b} | {mg:.2f} ({min(g):.2f}-{max(g):.2f}) | {me:.2f} ({min(e):.2f}-{max(e):.2f})"
            f" | {me / mg:.2f}x | {b / mg * 1e3:.0f} | {roof} |"
        )
    print(json.dumps({"weights_gb": weight_bytes / 1e9}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
