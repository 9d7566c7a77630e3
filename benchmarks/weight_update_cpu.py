"""How long new weights take to answer: /update_weights_from_disk against restarting.

    python benchmarks/weight_update_cpu.py
    python benchmarks/weight_update_cpu.py --rounds 5

SmolLM2-135M-Instruct's shipped GGUF file (Q4_1) is served by `kiln serve`; each round a
"fine-tuned" copy of it is made (the same file with the 4-bit codes of every layer's
down projection changed, a different change each round, so nothing is in the compile
cache and the answers change). Timed, from the moment the new file exists to the first
answer of the new weights, rounds alternating:
- update: POST /update_weights_from_disk with the new file (kiln compiles it in a child
  process and copies the weights into the running server), then one completion;
- update, cached: the same with a file the compile cache already holds (the child
  process and the copy alone);
- restart: what a server without the route needs: `kiln compile` of the new file, a new
  `kiln serve` started to its first answered token (the old one stopped first).
llama.cpp's server has no such route: its way is the restart (not measured here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import print_table, read_bandwidth_gbs, spread
from serve_bench import Server, free_port

from kiln.example import fetch

ADMIN = "bench-admin"
ASK = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def tuned(shipped: Path, out: Path, seed: int) -> Path:
    """A copy of the GGUF file whose down projections' 4-bit codes are changed (scales
    and minima kept, so the model stays well formed)."""
    import gguf

    shutil.copyfile(shipped, out)
    reader = gguf.GGUFReader(shipped)
    with out.open("r+b") as f:
        for t in reader.tensors:
            if (
                not t.name.endswith("ffn_down.weight")
                or t.tensor_type != gguf.GGMLQuantizationType.Q4_1
            ):
                continue
            for block in range(0, int(t.n_bytes) // 20, 7):  # 20-byte blocks: d, m, 16 code bytes
                f.seek(int(t.data_offset) + 20 * block + 4 + seed % 16)
                f.write(bytes([(seed * 37 + block) % 256]))
    return out


def serve(art: Path, threads: int, log: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", str(art), "--port", str(port)]
    cmd += ["--threads", str(threads), "--admin-api-key", ADMIN]
    return Server(cmd, port, log)


def answer(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json=ASK, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def compile_to(model: Path, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "kiln", "compile", "--model-path", str(model), "-o", str(out)],
        check=True,
        capture_output=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    shipped = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-wupdate-"))
    compile_to(shipped, work / "art")
    times: dict[str, list[float]] = {"update": [], "update, cached": [], "restart": []}
    srv = serve(work / "art", args.threads, work / "log")
    base = answer(srv.url)
    try:
        for r in range(args.rounds):
            order = list(times) if r % 2 == 0 else list(times)[::-1]
            for case in order:
                k = order.index(case)
                new = tuned(shipped, work / f"tuned-{r}-{k}.gguf", 1 + 3 * r + k)
                if case == "update, cached":
                    compile_to(new, work / "warm")  # now in the cache
                t0 = time.perf_counter()
                if case == "restart":
                    srv.stop()
                    compile_to(new, work / f"art-{r}")
                    srv = serve(work / f"art-{r}", args.threads, work / "log")
                else:
                    body = {"model_path": str(new)}
                    headers = {"Authorization": f"Bearer {ADMIN}"}
                    u = httpx.post(srv.url + "/update_weights_from_disk", json=body,
                                   headers=headers, timeout=600)  # fmt: skip
                    assert u.status_code == 200, u.text
                text = answer(srv.url)
                times[case].append(time.perf_counter() - t0)
                print(f"round {r} {case}: {times[case][-1]:.2f} s, {text!r} (shipped: {base!r})",
                      flush=True)  # fmt: skip
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    slowest = statistics.median(times["restart"])
    rows = [
        f"| {case} | {spread(ts)} | {slowest / statistics.median(ts):.2f}x |"
        for case, ts in times.items()
    ]
    title = "Seconds from a new checkpoint to its first answer, SmolLM2-135M-Instruct Q4_1"
    print_table(title, read_bandwidth_gbs(), args.rounds, args.threads,
                ["how", "s to the first new answer", "against restarting"], rows)  # fmt: skip


if __name__ == "__main__":
    main()
