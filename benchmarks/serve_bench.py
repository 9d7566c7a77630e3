"""Serving speed against llama-server, measured with SGLang's own load client.

    python benchmarks/serve_bench.py --llama-server ~/llama.cpp/build/bin/llama-server
    python benchmarks/serve_bench.py --llama-server ... --precisions F32 Q8_0 \\
        --concurrency 1 16 64 --rounds 3

Both servers run the real model (SmolLM2-135M-Instruct, `python -m kiln.example --fetch
smollm2`) from the same GGUF file at each precision (llama.cpp's quantizer writes F32 and
Q8_0 from the shipped Q4_1; kiln compiles that file, its blocks kept as stored, so both
run identical weights). The load is `python -m sglang.bench_serving --backend sglang-oai
--dataset-name random --random-range-ratio 1.0` (streamed /v1/completions, ignore_eos):
install it with `pip install --no-deps sglang==0.5.6` plus what its `--help` asks for
(orjson, pybase64, aiohttp, ...; later sglang releases import torchvision and, through it,
a CUDA torch). Its random prompts are cut from a ShareGPT-shaped file this script writes
from benchmarks/data/quality_text.txt, one conversation per word offset, so no two prompts
share a first token and neither server's prefix cache serves anything. With `--dataset
generated-shared-prefix` the load is SGLang's own for prefix caching instead: each prompt
one of --gsp-num-groups random system prompts, then a random question of --input-len
tokens, the groups' prompts shuffled together.

Servers take turns, one at a time on the machine: for each precision, round and
concurrency, kiln then llama-server (the order flips every round), each started fresh with
as many slots as the largest concurrency (`kiln serve --max-running-requests C`,
`llama-server -np C -c C*(input+output+64) -t T -tb T --flash-attn off`: llama-bench's
faster setting at batch 1 on CPU, see --llama-flash-attn; the serving tables in RESULTS.md
before 2026-11-26's fourth session ran its default, auto). Start to first token is the
wall time from launching the server to the first answer of a one-token completion, with
kiln's bytecode compiled first (as a wheel install has it; an editable install under
PYTHONDONTWRITEBYTECODE would compile kiln's source at every start, ~0.2 s here).
Reported: the median and spread (min-max) over rounds of output throughput, TTFT p50/p99
and ITL p50/p99, and the ratios kiln / llama-server of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import HERE, PRECISIONS, gguf_for, machine, read_bandwidth_gbs

SPEC = "kiln NGRAM"  # the server of --speculative-algorithm
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def compile_bytecode() -> None:
    """kiln's bytecode, as `pip install` of a wheel writes it (a no-op where it is there)."""
    import compileall
    import importlib.util

    for name in ("kiln", *(f"kiln.{p}" for p in PACKAGES)):
        spec = importlib.util.find_spec(name)
        for folder in (spec and spec.submodule_search_locations) or ():
            compileall.compile_dir(folder, quiet=1)


PACKAGES = ("compiler", "runtime", "models", "kernels", "passes", "serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sharegpt_file(out: Path, words_per_prompt: int = 400) -> Path:
    """Conversations in ShareGPT's shape, one starting at every word of our own text (so
    prompts differ from their first token), each first turn long enough for any input."""
    words = (HERE / "data" / "quality_text.txt").read_text().split()
    ring = words * (words_per_prompt // len(words) + 2)
    convs = [
        {
            "conversations": [
                {"from": "human", "value": " ".join(ring[i : i + words_per_prompt])},
                {"from": "gpt", "value": "Yes."},
            ]
        }
        for i in range(len(words))
    ]
    out.write_text(json.dumps(convs))
    return out


class Server:
    """One server process: `kiln serve` or `llama-server`, started and timed to its first
    answered token."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        body = {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        deadline = t0 + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}; see {log}")
            try:
                r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise RuntimeError(f"{cmd[0]} did not answer within 300 s; see {log}")
            time.sleep(0.05)
        self.start_s = time.perf_counter() - t0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bench(
    url: str, tokenizer: Path, dataset: Path, args: argparse.Namespace, conc: int, seed: int
) -> dict:
    prompts = max(args.min_prompts, args.prompts_per_client * conc)
    if args.dataset == "random":
        load = ["--dataset-name", "random", "--dataset-path", str(dataset)]
        load += ["--random-input-len", str(args.input_len)]
        load += ["--random-output-len", str(args.output_len), "--random-range-ratio", "1.0"]
    else:  # SGLang's: groups of prompts, each a group's system prompt then a question
        per_group = -(-prompts // args.gsp_num_groups)
        prompts = per_group * args.gsp_num_groups
        load = ["--dataset-name", "generated-shared-prefix"]
        load += ["--gsp-num-groups", str(args.gsp_num_groups)]
        load += ["--gsp-prompts-per-group", str(per_group)]
        load += ["--gsp-system-prompt-len", str(args.gsp_system_prompt_len)]
        load += ["--gsp-question-len", str(args.input_len)]
        load += ["--gsp-output-len", str(args.output_len)]
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = Path(f.name)
    cmd = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang-oai",
        "--base-url",
        url,
        "--model",
        "m",
        "--tokenizer",
        str(tokenizer),
        *load,
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(conc),
        "--seed",
        str(seed),
        "--output-file",
        str(out),
        "--disable-tqdm",
    ]
    # Not from the checkout: `-m` puts the working directory first on the path, where the
    # repository's kernels/ would stand in for the `kernels` package transformers imports.
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if run.returncode != 0 or not out.stat().st_size:
        sys.exit(f"sglang.bench_serving failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    res = json.loads(out.read_text().splitlines()[-1])
    out.unlink()
    if res["completed"] != prompts:
        sys.exit(
            f"{url}: {prompts - res['completed']} of {prompts} requests failed:\n"
            f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        )
    return {k: float(res[k]) for k in METRICS}


def spread(xs: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    p.add_argument("--precisions", nargs="+", default=["F32", "Q8_0"], choices=list(PRECISIONS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--dataset",
        choices=("random", "generated-shared-prefix"),
        default="random",
        help="bench_serving's load: random prompts sharing nothing, or SGLang's "
        "generated-shared-prefix (--gsp-num-groups system prompts of "
        "--gsp-system-prompt-len tokens, each followed by --input-len tokens of question)",
    )
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-client", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kiln-args", default="", help="extra `kiln serve` flags")
    p.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server flags (e.g. `-ub 1` for a build whose batched kernels "
        "fault: decode_cpu.py --llama-decode-ubatch)",
    )
    p.add_argument(
        "--llama-flash-attn",
        choices=("on", "off", "auto"),
        default="off",
        help="llama-server's --flash-attn (default off). Its own default, auto, turns it on "
        "for this CPU, where llama-bench decoded 25-70%% slower with it on at batch 1 "
        "(bench_common.llama_bench_rate)",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="kiln's KV pool (compile flag), as SGLang's"
    )
    p.add_argument(
        "--quantize-activations",
        default=None,
        help="kiln's compile flag for the quantized precisions (int8: llama.cpp's own "
        "arithmetic on its blocks, int8 activations per block); F32 ignores it",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=("NGRAM",),
        help="also a kiln server of the artefact compiled with it, alternating with the others",
    )
    args = p.parse_args()
    if not args.llama_server.is_file():
        sys.exit(f"--llama-server: no such file: {args.llama_server}")

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    compile_bytecode()
    work = Path(tempfile.mkdtemp(prefix="kiln-serve-bench-"))
    dataset = sharegpt_file(work / "sharegpt.json")
    shipped = fetch("smollm2")
    slots = max(args.concurrency)
    prompt_len = args.input_len
    if args.dataset != "random":  # a system prompt, a blank line and the question, whose
        # random tokens, decoded and encoded again, come out up to a third longer
        prompt_len = (args.gsp_system_prompt_len + args.input_len) * 4 // 3 + 8
    bw = read_bandwidth_gbs()
    results: dict[tuple[str, str, int], list[dict]] = {}
    starts: dict[tuple[str, str], list[float]] = {}
    beside = args.llama_server.parent / "llama-quantize"
    quantizer = beside if beside.is_file() else None
    for precision in args.precisions:
        gguf = gguf_for(precision, shipped, work, quantizer)
        art = work / f"art-{precision}"
        flags = {"kv_cache_dtype": args.kv_cache_dtype}
        if args.quantize_activations and precision != "F32":
            flags["quantize_activations"] = args.quantize_activations
        compile_model(ServerArgs(model_path=str(gguf), **flags), art)
        serve = [sys.executable, "-m", "kiln", "serve"]
        serve_flags = ["--max-running-requests", str(slots), "--log-level", "warning"]
        serve_flags += args.kiln_args.split()
        cmds = {
            "kiln": [*serve, str(art), *serve_flags],
            "llama-server": [
                str(args.llama_server),
                "-m",
                str(gguf),
                "-np",
                str(slots),
                "-c",
                str(slots * (prompt_len + args.output_len + 64)),
                "-t",
                str(args.threads),
                "-tb",
                str(args.threads),
                "--flash-attn",
                args.llama_flash_attn,
                "--log-disable",
                *args.llama_args.split(),
            ],
        }
        if args.speculative_algorithm:
            spec_art = work / f"art-{precision}-{args.speculative_algorithm}"
            spec_flags = {**flags, "speculative_algorithm": args.speculative_algorithm}
            compile_model(ServerArgs(model_path=str(gguf), **spec_flags), spec_art)
            cmds[SPEC] = [*serve, str(spec_art), *serve_flags]
        for r in range(args.rounds):
            order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
            for conc in args.concurrency:
                for name in order:
                    port = free_port()
                    extra = ["--port", str(port), "--host", "127.0.0.1"]
                    srv = Server(cmds[name] + extra, port, work / f"{name}.log")
                    try:
                        starts.setdefault((precision, name), []).append(srv.start_s)
                        got = bench(srv.url, art / "tokenizer", dataset, args, conc, 100 + r)
                    finally:
                        srv.stop()
                    results.setdefault((precision, name, conc), []).append(got)
                    print(
                        f"{precision} round {r + 1} c={conc} {name}: "
                        f"{got['output_throughput']:.1f} tok/s, start {srv.start_s:.2f} s, "
                        + json.dumps(got),
                        file=sys.stderr,
                    )

    print(
        f"\n## serve_bench: kiln serve against llama-server, SmolLM2-135M-Instruct, "
        f"{args.input_len} in / {args.output_len} out, {args.rounds} alternating rounds"
        + (
            f", generated-shared-prefix: {args.gsp_num_groups} system prompts of "
            f"{args.gsp_system_prompt_len} tokens before each prompt"
            if args.dataset != "random"
            else ""
        )
    )
    print(machine())
    print(
        f"measured read bandwidth {bw:.1f} GB/s; {args.threads} threads each; "
        f"{slots} slots each; kiln --kv-cache-dtype {args.kv_cache_dtype}"
        + (
            f", --quantize-activations {args.quantize_activations} (quantized precisions)"
            if args.quantize_activations
            else ""
        )
        + (f", kiln serve {args.kiln_args}" if args.kiln_args else "")
        + "; median (min-max) over rounds\n"
    )
    print(
        "| precision | clients | server | output tok/s | TTFT p50 ms | TTFT p99 ms | "
        "ITL p50 ms | ITL p99 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    for precision in args.precisions:
        for conc in args.concurrency:
            med = {}
            for name in cmds:
                runs = results[(precision, name, conc)]
                cols = [spread([x[k] for x in runs]) for k in METRICS]
                med[name] = {k: statistics.median(x[k] for x in runs) for k in METRICS}
                print(f"| {precision} | {conc} | {name} | " + " | ".join(cols) + " |")
            k, ll = med["kiln"], med["llama-server"]
            ratios.append(
                f"| {precision} | {conc} | "
                f"{k['output_throughput'] / ll['output_throughput']:.2f}x | "
                f"{k['median_ttft_ms'] / ll['median_ttft_ms']:.2f}x | "
                f"{k['median_itl_ms'] / ll['median_itl_ms']:.2f}x |"
            )
    print(
        "\nkiln / llama-server, ratios of medians (throughput: higher is better; TTFT and "
        "ITL: lower is better)\n"
    )
    print("| precision | clients | output throughput | TTFT p50 | ITL p50 |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(ratios))
    if args.speculative_algorithm:
        print(f"\n{SPEC} / kiln (the same artefact compiled without it), ratios of medians\n")
        print("| precision | clients | output throughput | TTFT p50 | ITL p50 |")
        print("| --- | --- | --- | --- | --- |")
        for precision in args.precisions:
            for conc in args.concurrency:
                a, b = (
                    {
                        k: statistics.median(x[k] for x in results[(precision, n, conc)])
                        for k in METRICS
                    }
                    for n in (SPEC, "kiln")
                )
                print(
                    f"| {precision} | {conc} | "
                    f"{a['output_throughput'] / b['output_throughput']:.2f}x | "
                    f"{a['median_ttft_ms'] / b['median_ttft_ms']:.2f}x | "
                    f"{a['median_itl_ms'] / b['median_itl_ms']:.2f}x |"
                )
    print("\nStart to first token, s, median (min-max) over every start\n")
    print("| precision | kiln serve | llama-server |")
    print("| --- | --- | --- |")
    for precision in args.precisions:
        print(
            f"| {precision} | {spread(starts[(precision, 'kiln')], '.2f')} | "
            f"{spread(starts[(precision, 'llama-server')], '.2f')} |"
        )


if __name__ == "__main__":
    main()
