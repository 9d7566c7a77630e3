"""Batch-1 decode with speculative decoding (NGRAM, and with --draft a Q4_1 draft model)
against llama-server's own, on prompts that repeat their context and on prompts that do not.

    python benchmarks/speculative_cpu.py --llama-server ~/llama.cpp/build/bin/llama-server
    python benchmarks/speculative_cpu.py --llama-server ... --precisions F32 Q4_1 --rounds 3
    python benchmarks/speculative_cpu.py --llama-server ... --precisions F32 --draft

Four servers per precision (six with --draft), on the real model (SmolLM2-135M-Instruct)
from the same GGUF file, each started alone on the machine, in an order that flips every
round: `kiln serve` of an artefact compiled without and with `--speculative-algorithm
NGRAM`, and `llama-server` without and with `--spec-type ngram-simple` (its prompt-lookup
drafting: the last n tokens looked up in the context, the m after an earlier match
drafted); with --draft also kiln's STANDALONE artefact and `llama-server -md` (`--spec-type
draft-simple`), both drafted by the shipped Q4_1 file. One
client sends each prompt as a streamed greedy /v1/completions request of a fixed length
(ignore_eos); decode speed is (tokens - 1) / (time from the first streamed token to the
last), so prefill is left out. kiln's acceptance (tokens landed per verify step) is read
from an in-process engine on the same prompts afterwards.

The prompts: "repeat" ones ask the model to copy or edit text it was given (a function
with a variable renamed, sentences quoted), where drafts from the context are often right;
"fresh" ones ask for new text, where drafts rarely are and speculation must not lose.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import HERE, PRECISIONS, gguf_for, machine, read_bandwidth_gbs, spread
from serve_bench import Server, free_port

CODE = """def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] == "paid":
            total += order["amount"]
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
"""
PROMPTS = {
    "repeat": [
        CODE + "\n# The same function with the variable `total` renamed to `paid_sum`:\n",
        "The text: "
        + " ".join((HERE / "data" / "quality_text.txt").read_text().split()[:90])
        + "\n\nThe same text, copied word for word: ",
    ],
    "fresh": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Here are five facts about the planet Mars:\n1.",
    ],
}


def stream_rate(url: str, prompt: str, tokens: int) -> float:
    """Decode tokens a second of one streamed greedy completion of `tokens` tokens."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    count = 0
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
                count += 1
    n = usage or count
    if first is None or last is None or last <= first or n < 2:
        raise RuntimeError(f"{url}: no timed stream ({n} tokens)")
    return (n - 1) / (last - first)


def accept_lengths(art: Path, tokens: int) -> dict[str, float]:
    """Tokens landed per verify step by kiln's NGRAM engine, per prompt kind."""
    from kiln import Engine

    engine = Engine(art, max_total_tokens=4096)
    out = {}
    for kind, prompts in PROMPTS.items():
        params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
        metas = [engine.generate(p, params)["meta_info"] for p in prompts]
        steps = sum(m["spec_verify_ct"] for m in metas)
        kept = sum(m["spec_accept_token_num"] for m in metas)
        out[kind] = 1 + kept / steps if steps else 1.0
    engine.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    p.add_argument("--precisions", nargs="+", default=["F32", "Q4_1"], choices=list(PRECISIONS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="tokens each completion decodes")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--quantize-activations",
        default=None,
        help="kiln's compile flag for the quantized precisions (F32 ignores it)",
    )
    p.add_argument(
        "--draft-max", type=int, default=16, help="llama-server --spec-draft-n-max (its drafts)"
    )
    p.add_argument(
        "--draft",
        action="store_true",
        help="also the shipped Q4_1 file as a draft model for each other precision "
        "(kiln STANDALONE against llama-server -md)",
    )
    args = p.parse_args()
    if not args.llama_server.is_file():
        sys.exit(f"--llama-server: no such file: {args.llama_server}")

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    work = Path(tempfile.mkdtemp(prefix="kiln-spec-bench-"))
    shipped = fetch("smollm2")
    beside = args.llama_server.parent / "llama-quantize"
    quantizer = beside if beside.is_file() else None
    bw = read_bandwidth_gbs()
    rates: dict[tuple[str, str, str], list[float]] = {}
    accept: dict[str, dict[str, float]] = {}
    context = 4 * (args.tokens + 512)
    for precision in args.precisions:
        gguf = gguf_for(precision, shipped, work, quantizer)
        flags = {}
        if args.quantize_activations and precision != "F32":
            flags["quantize_activations"] = args.quantize_activations
        arts = {}
        variants: list[tuple[str, dict]] = [("kiln", {})]
        variants.append(("kiln NGRAM", {"speculative_algorithm": "NGRAM"}))
        standalone = args.draft and precision != "Q4_1"
        if standalone:
            draft = {"speculative_draft_model_path": str(shipped)}
            variants.append(("kiln Q4_1 draft", {"speculative_algorithm": "STANDALONE", **draft}))
        for name, extra in variants:
            arts[name] = work / f"art-{precision}-{len(arts)}"
            compile_model(ServerArgs(model_path=str(gguf), **flags, **extra), arts[name])
        llama = [str(args.llama_server), "-m", str(gguf), "-np", "1", "-c", str(context)]
        llama += ["-t", str(args.threads), "-tb", str(args.threads), "--log-disable"]
        # its faster setting at batch 1 on CPU (bench_common.llama_bench_rate); auto is on
        llama += ["--flash-attn", "off"]
        kiln = [sys.executable, "-m", "kiln", "serve", "--log-level", "warning"]
        cmds = {name: [*kiln, str(art)] for name, art in arts.items()}
        cmds["llama-server"] = llama
        cmds["llama-server ngram"] = [
            *llama,
            *("--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.draft_max)),
        ]
        if standalone:
            # The same draft file and as many drafts a step as kiln's default (3).
            cmds["llama-server Q4_1 draft"] = [
                *llama,
                *("-md", str(shipped), "--spec-type", "draft-simple"),
                *("--spec-draft-n-max", "3", "-td", str(args.threads)),
            ]
        for r in range(args.rounds):
            order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
            for name in order:
                port = free_port()
                srv = Server(
                    [*cmds[name], "--port", str(port), "--host", "127.0.0.1"],
                    port,
                    work / f"{name.replace(' ', '-')}.log",
                )
                try:
                    for kind, prompts in PROMPTS.items():
                        got = [stream_rate(srv.url, q, args.tokens) for q in prompts]
                        rates.setdefault((precision, name, kind), []).append(statistics.mean(got))
                        print(
                            f"{precision} round {r + 1} {name} {kind}: "
                            + ", ".join(f"{g:.1f}" for g in got)
                            + " tok/s",
                            file=sys.stderr,
                        )
                finally:
                    srv.stop()
        accept[precision] = accept_lengths(arts["kiln NGRAM"], args.tokens)
        if standalone:
            accept[precision + " draft"] = accept_lengths(arts["kiln Q4_1 draft"], args.tokens)

    print(
        "\n## speculative_cpu: batch-1 decode with NGRAM against llama-server's ngram-simple, "
        f"SmolLM2-135M-Instruct, {args.tokens} tokens a completion"
    )
    print(machine())
    print(
        f"measured read bandwidth {bw:.1f} GB/s; {args.rounds} alternating rounds, median "
        f"(min-max) of each round's mean over the kind's prompts; {args.threads} threads each; "
        f"llama-server --spec-draft-n-max {args.draft_max}; kiln --quantize-activations "
        f"{args.quantize_activations or 'none'}\n"
    )
    ngram = ("NGRAM", "kiln NGRAM", "llama-server ngram-simple", "llama-server ngram")
    table(rates, accept, args.precisions, "", ngram)
    drafted = [p for p in args.precisions if p + " draft" in accept]
    if drafted:
        print(
            "\nWith a draft model: the shipped Q4_1 file drafting for the file above (kiln: "
            "`--speculative-algorithm STANDALONE`, its int8 activations; llama-server: `-md` "
            "with `--spec-type draft-simple --spec-draft-n-max 3`)\n"
        )
        draft = ("+ Q4_1 draft", "kiln Q4_1 draft", "llama-server + Q4_1 draft")
        table(rates, accept, drafted, " draft", (*draft, "llama-server Q4_1 draft"))


def table(
    rates: dict[tuple[str, str, str], list[float]],
    accept: dict[str, dict[str, float]],
    precisions: list[str],
    suffix: str,
    names: tuple[str, str, str, str],
) -> None:
    """One markdown table: kiln plain and speculative, llama-server plain and speculative
    (`names`: the speculative column's label, kiln's server, llama-server's label and
    server), per file and prompt kind, with the ratios."""
    label, ours, their_label, theirs = names
    header = ["file", "prompts", "kiln", f"kiln {label}", f"{label} / plain", "accept length"]
    header += ["llama-server", their_label, f"kiln {label} / {their_label}"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for precision in precisions:
        for kind in PROMPTS:
            got = {n: rates[(precision, n, kind)] for n in ("kiln", ours, "llama-server", theirs)}
            med = {n: statistics.median(v) for n, v in got.items()}
            print(
                f"| {precision} | {kind} | {spread(got['kiln'])} | {spread(got[ours])} | "
                f"{med[ours] / med['kiln']:.2f}x | {accept[precision + suffix][kind]:.2f} | "
                f"{spread(got['llama-server'])} | {spread(got[theirs])} | "
                f"{med[ours] / med[theirs]:.2f}x |"
            )


if __name__ == "__main__":
    main()
