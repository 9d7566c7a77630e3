"""Compile and start-up costs, and serving memory, of a real model shape.

    python benchmarks/compile_and_start.py                 # SmolLM2-135M shape, fp32
    python benchmarks/compile_and_start.py --config ../shared/model-configs/qwen2.5-0.5b.json
    python benchmarks/compile_and_start.py --model-path model.gguf --shared-kernels

A checkpoint of the config's shape with random weights (safetensors, fp32, as
`save_pretrained` writes it) is made once, or --model-path names a real one (a folder or a
GGUF file). Each round, in a fresh cache folder (--shared-kernels: but for the kernel
store, built by an untimed compile first, so a cold compile is the model's own work):
  cold compile   `kiln compile --model-path CKPT` (key, trace, passes, C kernels, weights)
  hit            the same command again (a new process: start-up included)
  key            `kiln cache key --model-path CKPT` (file hashes remembered)
  key, rehashed  the same with --rehash: every checkpoint byte read and hashed
  first token    from starting `kiln serve` to the first /generate answer (1 new token)
  serving RSS    after 8 requests (128-token prompts, 32 new tokens each, 4 at once),
                 against the budget weights x 1.1 + KV pool + 400 MB
Wall times are medians (and min-max) over --rounds rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import machine

SMOLLM2 = Path(__file__).resolve().parents[1] / ".." / "shared/model-configs/smollm2-135m.json"


def make_checkpoint(config: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**json.loads(config.read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def kiln(*args: str, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kiln", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"kiln {' '.join(args)} failed:\n{done.stderr}")
    return time.perf_counter() - t0, done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_round(art: Path, env: dict[str, str], max_total_tokens: int) -> tuple[float, int]:
    """(seconds from start to the first token, RSS bytes after a few requests)."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["serve", str(art), "--port", str(port), "--skip-tokenizer-init"]
    argv += ["--max-total-tokens", str(max_total_tokens), "--skip-server-warmup"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit("kiln serve exited")
            try:
                if httpx.post(url + "/generate", json=body, timeout=60).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        first = time.perf_counter() - t0

        def one(i: int) -> None:
            req = {
                "input_ids": [(i * 7 + j) % 1000 + 5 for j in range(128)],
                "sampling_params": {"max_new_tokens": 32, "ignore_eos": True},
            }
            assert httpx.post(url + "/generate", json=req, timeout=300).status_code == 200

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(8)))
        rss = 0
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        return first, rss
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def spread(xs: list[float], unit: str = "s", scale: float = 1.0) -> str:
    xs = [x * scale for x in xs]
    return f"{statistics.median(xs):.2f} {unit} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=SMOLLM2)
    p.add_argument("--model-path", type=Path, help="compile this checkpoint instead")
    p.add_argument("--shared-kernels", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    try:
        ckpt = args.model_path or make_checkpoint(args.config, work / "ckpt")
        kernels = work / "kernels"

        def cache_env(name: str) -> dict[str, str]:
            """A fresh cache folder's environment, linked to the shared kernel store."""
            if args.shared_kernels:
                kernels.mkdir(exist_ok=True)
                (work / name).mkdir()
                (work / name / "kernels").symlink_to(kernels)
            return dict(os.environ, KILN_CACHE_DIR=str(work / name))

        if args.shared_kernels:  # an untimed compile builds the store
            kiln("compile", "--model-path", str(ckpt), env=cache_env("warm"))
        names = ("cold", "hit", "key", "rehash", "first")
        times: dict[str, list[float]] = {k: [] for k in names}
        rss: list[int] = []
        for r in range(args.rounds):
            env = cache_env(f"cache{r}")
            cold, out = kiln("compile", "--model-path", str(ckpt), env=env)
            art = Path(out.splitlines()[-1].split()[1])
            hit, out = kiln("compile", "--model-path", str(ckpt), env=env)
            assert out.startswith("cache hit"), out
            key, _ = kiln("cache", "key", "--model-path", str(ckpt), env=env)
            rehash, _ = kiln("cache", "key", "--model-path", str(ckpt), "--rehash", env=env)
            first, used = serve_round(art, env, args.max_total_tokens)
            for name, v in zip(times, (cold, hit, key, rehash, first), strict=True):
                times[name].append(v)
            rss.append(used)
        summary = json.loads(kiln("inspect", str(art), "--json", env=env)[1])
        weights = (art / "weights/rank0.safetensors").stat().st_size
        kv = summary["kv_cache"]["bytes_per_token"] * args.max_total_tokens
        budget = weights * 1.1 + kv + 400e6
        print(machine())
        model = args.model_path.name if args.model_path else args.config.name
        print(f"model: {model}, {summary['target']}, {summary['dtype']}")
        print("| measure | median (min-max) |")
        print("| --- | --- |")
        print(f"| cold compile (`kiln compile`) | {spread(times['cold'])} |")
        print(f"| cache hit (`kiln compile`, new process) | {spread(times['hit'])} |")
        print(f"| `kiln cache key` | {spread(times['key'])} |")
        print(f"| `kiln cache key --rehash` | {spread(times['rehash'])} |")
        print(f"| serve start to first token | {spread(times['first'])} |")
        print(f"| serving RSS | {spread([float(x) for x in rss], 'MB', 1e-6)} |")
        print(
            f"\nRSS budget: weights {weights / 1e6:.0f} MB x 1.1 + KV pool {kv / 1e6:.0f} MB "
            f"+ 400 MB = {budget / 1e6:.0f} MB; median RSS is "
            f"{statistics.median(rss) / budget:.0%} of it"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
