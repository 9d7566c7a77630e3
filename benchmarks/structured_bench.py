"""What JSON-schema-constrained decoding costs under load, in kiln and in llama-server.

    python benchmarks/structured_bench.py --llama-server ~/llama.cpp/build/bin/llama-server
    python benchmarks/structured_bench.py --llama-server ... --clients 16 --rounds 3

Both servers run the real model (SmolLM2-135M-Instruct, the shipped Q4_1 GGUF file, which
kiln compiles with its blocks kept as stored: identical weights). `--clients` closed-loop
clients each send `--requests` chat completions (non-streamed, temperature 0.8, a seed
each, `--max-tokens`), asking for five cities of a country as JSON:

- constrained: OpenAI's `response_format: {"type": "json_schema", ...}` with the schema
  below (both servers take it: kiln compiles it with xgrammar, llama-server turns it into
  a GBNF grammar);
- unconstrained: the same requests without it, each with `ignore_eos` and `max_tokens` set
  to the length of the same request's constrained answer on that server (measured in an
  untimed pass when the server first starts), so both modes generate the same tokens at
  the same context lengths and only the constraint differs.

Reported per server: output tokens per second (all completion tokens / wall time) in
each mode, the cost of the constraint (1 - constrained / unconstrained throughput), the
share of constrained outputs that parse and validate (`jsonschema`), and kiln /
llama-server. Servers take turns, one at a time on the machine, each started fresh every
round (the order flips every round); each start runs `--pairs` pairs of the two modes, in
alternating order (AB, BA, ...), and the cost is taken within each pair, so a machine
that slows down for a while moves both runs of a pair; each is
warmed up with one request of each mode first (kiln caches the compiled schema;
llama-server turns the schema into a grammar for each request). Median (min-max) over
every run (the cost: over every pair).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, read_bandwidth_gbs, shipped_artefact
from serve_bench import Server, free_port, spread

SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 5,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                },
                "required": ["name", "population"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
COUNTRIES = (  # noqa: SIM905
    "France Italy Spain Germany Japan Brazil Canada India Egypt Kenya Peru Chile Norway "
    "Poland Greece Mexico Turkey Vietnam Ghana Sweden Portugal Austria Nigeria Argentina"
).split()
MODES = ("unconstrained", "json_schema")


def body(i: int, mode: str, max_tokens: int, lengths: dict[int, int]) -> dict:
    ask = f"List five cities of {COUNTRIES[i % len(COUNTRIES)]} with their populations as JSON."
    out = {
        "model": "m",
        "messages": [{"role": "user", "content": ask}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
    }
    if mode == "json_schema":
        schema = {"name": "cities", "schema": SCHEMA}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        out["ignore_eos"] = True
        out["max_tokens"] = lengths.get(i, max_tokens)
    return out


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def load(
    url: str, mode: str, clients: int, per_client: int, max_tokens: int, lengths: dict[int, int]
) -> dict:
    """`clients` closed loops of `per_client` requests each: output tok/s, the share of
    valid answers, and each request's completion tokens (`counts`)."""
    counts: dict[int, int] = {}
    valid = 0

    async def client(c: httpx.AsyncClient, k: int) -> None:
        nonlocal valid
        for j in range(per_client):
            i = k * per_client + j
            r = await c.post("/v1/chat/completions", json=body(i, mode, max_tokens, lengths))
            r.raise_for_status()
            reply = r.json()
            counts[i] = reply["usage"]["completion_tokens"]
            valid += valid_json(reply["choices"][0]["message"]["content"])

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, k) for k in range(clients)))
        wall = time.perf_counter() - t0
    tokens = sum(counts.values())
    return {
        "tok_s": tokens / wall,
        "valid": valid / len(counts),
        "tokens": tokens,
        "wall_s": wall,
        "counts": counts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=2, help="per client, per mode and round")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=2, help="of the two modes, per server start")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kiln-args", default="", help="extra `kiln serve` flags")
    args = p.parse_args()
    if not args.llama_server.is_file():
        sys.exit(f"--llama-server: no such file: {args.llama_server}")

    work, gguf, art = shipped_artefact("kiln-structured-bench-")
    bw = read_bandwidth_gbs()
    slots = args.clients
    cmds = {
        "kiln": [
            sys.executable, "-m", "kiln", "serve", str(art),
            "--max-running-requests", str(slots), "--log-level", "warning",
            *args.kiln_args.split(),
        ],
        "llama-server": [
            str(args.llama_server), "-m", str(gguf), "-np", str(slots),
            "-c", str(slots * (64 + args.max_tokens + 64)),
            "-t", str(args.threads), "-tb", str(args.threads), "--log-disable",
        ],
    }  # fmt: skip
    results: dict[tuple[str, str], list[dict]] = {}
    lengths: dict[str, dict[int, int]] = {}
    shape = (args.clients, args.requests)
    for r in range(args.rounds):
        servers = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
        modes = MODES if r % 2 == 0 else MODES[::-1]
        for name in servers:
            port = free_port()
            extra = ["--port", str(port), "--host", "127.0.0.1"]
            srv = Server(cmds[name] + extra, port, work / f"{name}.log")
            try:
                if name not in lengths:  # the constrained answers' lengths, untimed
                    calibration = load(srv.url, "json_schema", *shape, args.max_tokens, {})
                    lengths[name] = asyncio.run(calibration)["counts"]
                for mode in MODES:  # warm-up: one request of each
                    asyncio.run(load(srv.url, mode, 1, 1, args.max_tokens, {}))
                for pair in range(args.pairs):  # AB, BA, AB...: drift cancels in the pairs
                    for mode in modes if pair % 2 == 0 else modes[::-1]:
                        lens = lengths[name]
                        got = asyncio.run(load(srv.url, mode, *shape, args.max_tokens, lens))
                        del got["counts"]
                        results.setdefault((name, mode), []).append(got)
                        print(f"round {r + 1} {name} {mode}: {json.dumps(got)}", file=sys.stderr)
            finally:
                srv.stop()

    print(
        f"\n## structured_bench: JSON-schema-constrained chat against unconstrained, kiln serve "
        f"and llama-server, SmolLM2-135M-Instruct Q4_1, {args.clients} clients x "
        f"{args.requests} requests, max {args.max_tokens} tokens, {args.rounds} alternating "
        f"rounds of {args.pairs} pairs"
    )
    print(machine())
    print(
        f"measured read bandwidth {bw:.1f} GB/s; {args.threads} threads each; {slots} slots "
        "each; median (min-max) over every run; the cost over each pair of runs\n"
    )
    print(
        "| server | unconstrained tok/s | json_schema tok/s | cost of the constraint | valid JSON |"
    )
    print("| --- | --- | --- | --- | --- |")
    med = {}
    for name in cmds:
        plain = [x["tok_s"] for x in results[(name, "unconstrained")]]
        cons = [x["tok_s"] for x in results[(name, "json_schema")]]
        costs = [1 - c / u for u, c in zip(plain, cons, strict=True)]
        valid = [x["valid"] for x in results[(name, "json_schema")]]
        med[name] = (statistics.median(plain), statistics.median(cons))
        print(
            f"| {name} | {spread(plain)} | {spread(cons)} | "
            f"{spread([100 * c for c in costs])} % | {spread([100 * v for v in valid], '.0f')} % |"
        )
    k, ll = med["kiln"], med["llama-server"]
    print(
        f"\nkiln / llama-server, output throughput: unconstrained {k[0] / ll[0]:.2f}x, "
        f"json_schema {k[1] / ll[1]:.2f}x"
    )


if __name__ == "__main__":
    main()
