"""What the benchmarks share: the SmolLM2-135M shape, the machine line, the measured read
bandwidth, the bytes a decode step reads, the GGUF files at each precision, kiln's engine in
a process of its own, llama-bench's rate, and the median (min-max) figure."""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import platform
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path
from typing import Any

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
    # block types kiln holds in a wider kernel format (kiln/core/quant.py, _TRANSCODED);
    # on SmolLM2's 576-wide rows llama.cpp falls back to Q4_0 / IQ4_NL for most matrices
    "Q2_K": 10,
    "Q3_K_M": 12,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
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


def shipped_artefact(prefix: str) -> tuple[Path, Path, Path]:
    """A new work folder, the shipped GGUF file (SmolLM2-135M-Instruct Q4_1) and its artefact
    compiled with the default flags into the folder (a cache hit after the first time)."""
    import tempfile

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import fetch

    work = Path(tempfile.mkdtemp(prefix=prefix))
    gguf = fetch("smollm2")
    compile_model(ServerArgs(model_path=str(gguf)), work / "art")
    return work, gguf, work / "art"


def print_table(
    title: str, bw: float, rounds: int, threads: int, header: list[str], rows: list[str]
) -> None:
    """A markdown table of alternating-round figures under its title, machine line and
    measured read bandwidth."""
    print(f"\n## {title}")
    print(machine())
    print(
        f"measured read bandwidth {bw:.1f} GB/s; {rounds} alternating rounds, median "
        f"(min-max); {threads} threads each\n"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    print("\n".join(rows))


def spread(xs: list[float]) -> str:
    """The median of `xs` with their range: `12.3 (11.0-13.1)`."""
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def llama_bench_rate(bench: Path, gguf: Path, threads: int, *flags: str) -> float:
    """Tokens a second of one `llama-bench` run (`-r 1`) of `flags` (e.g. `-p 0 -n 64 -d
    128`) on `gguf` with `threads` threads, at llama.cpp's better flash-attention setting:
    `-fa 0,1` runs both and the faster counts. Its default (auto) turned flash attention on
    for this CPU, and that decoded SmolLM2 Q4_0 at 132 tok/s where `-fa 0` ran 174 (a
    128-token depth; 30 against 91 at 1536): the default alone is a handicapped peer."""
    cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-fa", "0,1", "-o", "json"]
    done = subprocess.run([*cmd, *flags], check=True, capture_output=True, text=True)
    return max(float(run["avg_ts"]) for run in json.loads(done.stdout))


def _kiln_worker(art: str, threads: int, conn: Any, engine_args: dict[str, Any]) -> None:
    torch.set_num_threads(threads)
    from kiln import Engine
    from kiln.runtime.sampling_params import SamplingParams

    engine = Engine(
        art,
        max_total_tokens=2048,
        max_running_requests=1,
        disable_radix_cache=True,
        **engine_args,
    )
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        ids, new, lora = msg
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        req = engine.make_request(list(ids), params, lora=lora)
        engine.add_request(req)
        while not req.finished:
            engine.step()
        end = time.perf_counter()
        assert req.first_token_at is not None
        conn.send((end - t0, end - req.first_token_at))


class KilnProcess:
    """kiln's engine on artefact `art` in a process of its own (so neither its idle OpenMP
    threads nor the peer's compete with the other's), timing generations on request.
    `engine_args`: server arguments of the engine (e.g. lora_paths)."""

    def __init__(self, art: Path, threads: int, **engine_args: Any) -> None:
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_kiln_worker, args=(str(art), threads, child, engine_args), daemon=True
        )
        self.proc.start()
        assert self.conn.recv() == "ready"

    def time(self, ids: list[int], new: int, lora: str | None = None) -> float:
        """Seconds to generate `new` tokens greedily after prompt `ids`."""
        return self._run(ids, new, lora)[0]

    def decode_rate(self, prompt: list[int], n: int, lora: str | None = None) -> float:
        """Decode tokens a second after `prompt`: the n - 1 tokens after the first over the
        time from the first to the last, as llama-bench's `-n N -d DEPTH` leaves its depth's
        prefill out. (It was an n-token generation's time minus a one-token one's: at a
        1536-token depth the two prefills' noise swamped the decode, 700 tok/s one round.)"""
        return (n - 1) / self._run(prompt, n, lora)[1]

    def _run(self, ids: list[int], new: int, lora: str | None = None) -> tuple[float, float]:
        """(the whole generation's seconds, its seconds from the first token to the last),
        through LoRA adapter `lora` when given."""
        self.conn.send((ids, new, lora))
        total, decode = self.conn.recv()
        return float(total), float(decode)

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)
