"""Quality of each quantization scheme on the real model, against its float reference.

    python benchmarks/quality.py                 # kiln's schemes, and llama.cpp's if installed

The model is SmolLM2-135M-Instruct from its Q4_1 GGUF file (`python -m kiln.example --fetch
smollm2`); the float reference is that file read as fp32 (`--dtype float32`), so every other
variant is measured against the same weights. The text is benchmarks/data/quality_text.txt
(plain English written for this project), scored in windows of --window tokens.

Per variant: perplexity of the text, mean KL divergence KL(reference || variant) of the
next-token distribution, and top-1 agreement with the reference. llama.cpp's own runtime
(llama-cpp-python, logits of every position) is scored the same way on the file as shipped
(Q4_1) and on Q4_0 / Q8_0 files its own quantizer makes from it.

With `--llama-perplexity PATH/llama-perplexity` it scores GGUF K-quant files instead (the
Gemma 3 270M Q4_K_M file and SmolLM2 requantized to Q4_K_M, Q5_K_M and Q6_K by
`llama-quantize`, found beside it): each runtime against its own F32 logits of the same
weights (each file's source dequantized to an F32 GGUF by `llama-quantize`), on the same
positions: llama.cpp's own `--kl-divergence` (chunks of --window tokens, the second half of
each scored), kiln reading those chunks' tokens from llama.cpp's base file; kiln as
compiled by default (float32 activations) and with `--quantize-activations int8` (+a8,
llama.cpp's own arithmetic on these blocks).

The fp8 KV cache variants (`--kv-cache-dtype`) score the text as decoding reads it: one
token per step, every step attending to the earlier tokens through the fp8 pool (a single
prefill would attend to its fresh K/V and never read the pool). The reference is the float
model scored in one prefill; decoding with a float pool gives the same logits.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "quality_text.txt"

A8 = {"quantize_activations": "int8"}
# kiln variants: name -> compile flags on the GGUF file.
KILN = {
    "kiln float32 (reference)": {"dtype": "float32"},
    "kiln GGUF Q4_1 as stored": {},
    "kiln GGUF Q4_1, int8 activations": A8,
    "kiln int8wo": {"torchao_config": "int8wo"},
    "kiln w8a8_int8": {"quantization": "w8a8_int8"},
    "kiln fp8 (e4m3, per row)": {"quantization": "fp8"},
    "kiln int4wo-32": {"torchao_config": "int4wo-32"},
    "kiln int4wo-64": {"torchao_config": "int4wo-64"},
    "kiln fp8_e4m3 KV cache (decoded)": {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},
    "kiln fp8_e5m2 KV cache (decoded)": {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"},
}


def metrics(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> tuple[float, float, float]:
    """(sum of next-token NLL, sum of KL(ref || got), top-1 matches) over the positions
    that predict a token of `ids`."""
    ref_lp = torch.log_softmax(ref[:-1].double(), -1)
    got_lp = torch.log_softmax(got[:-1].double(), -1)
    target = torch.tensor(ids[1:])
    nll = -got_lp.gather(1, target[:, None]).sum().item()
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum().item()
    top1 = (ref_lp.argmax(-1) == got_lp.argmax(-1)).sum().item()
    return nll, kl, float(top1)


def kiln_scorer(gguf: Path, flags: dict, work: Path) -> Callable[[list[int]], torch.Tensor]:
    from kiln import Engine
    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model

    art = work / ("art-" + str(abs(hash(str((gguf, sorted(flags.items())))))))
    compile_model(ServerArgs(model_path=str(gguf), **flags), art)
    engine = Engine(art, max_total_tokens=4096, disable_radix_cache=True)
    chunk = 1 if flags.get("kv_cache_dtype", "auto") != "auto" else None
    return lambda ids: engine.prompt_logits(ids, chunk=chunk)


def llama_cpp_files(gguf: Path, work: Path) -> dict[str, Path]:
    """The shipped file and llama.cpp's own Q4_0 / Q8_0 requantizations of it."""
    import llama_cpp

    files = {"llama.cpp Q4_1 (the file)": gguf}
    for name, ftype in (("Q4_0", 2), ("Q8_0", 7)):
        out = work / f"smollm2-{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
        rc = llama_cpp.llama_model_quantize(
            str(gguf).encode(), str(out).encode(), ctypes.byref(params)
        )
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not make {name}: {rc}")
        files[f"llama.cpp {name}"] = out
    return files


def llama_cpp_scorer(path: Path, window: int) -> Callable[[list[int]], torch.Tensor]:
    from llama_cpp import Llama

    model = Llama(
        model_path=str(path),
        n_ctx=window,
        n_batch=window,
        logits_all=True,
        n_threads=2,
        verbose=False,
    )

    def score(ids: list[int]) -> torch.Tensor:
        model.reset()
        model.eval(ids)
        return torch.tensor(model.scores[: len(ids)], dtype=torch.float32)

    return score


def _run(cmd: list[str]) -> str:
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-800:]}")
    return done.stdout + done.stderr


def _kld_base(path: Path) -> tuple[int, int, list[list[int]]]:
    """llama-perplexity's --kl-divergence-base file: (n_ctx, n_vocab, the chunks' tokens)."""
    import struct

    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise RuntimeError(f"{path} is not a llama-perplexity base file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        flat = struct.unpack(f"<{n_ctx * n_chunk}i", f.read(4 * n_ctx * n_chunk))
    return n_ctx, n_vocab, [list(flat[i * n_ctx : (i + 1) * n_ctx]) for i in range(n_chunk)]


def _bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts first in each chunk, None where the vocabulary adds none."""
    from kiln.compiler.gguf_read import read

    fields = read(gguf).fields
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return bos if fields.get("tokenizer.ggml.add_bos_token") else None


def _llama_kld(out: str) -> tuple[float, float]:
    """(mean KL, same-top fraction) from llama-perplexity's --kl-divergence report."""
    import re

    kl = re.search(r"Mean\s+KLD:\s+([0-9.e+-]+)", out)
    top = re.search(r"Same top p:\s+([0-9.]+)", out)
    if kl is None or top is None:
        raise RuntimeError(f"no KL divergence in llama-perplexity's output: {out[-800:]}")
    return float(kl.group(1)), float(top.group(1)) / 100


def k_quant_quality(ppl: Path, window: int, threads: int) -> None:
    """KL against each runtime's F32 logits on K-quant files: kiln and llama.cpp."""
    from gguf_decode import files as k_quant_files

    from kiln.example import fetch

    work = Path(tempfile.mkdtemp(prefix="kiln-k-quality-"))
    quantize = str(ppl.parent / "llama-quantize")
    gemma, *mixes = k_quant_files(ppl, work)
    rows = []
    for source, variants in ((fetch("smollm2"), mixes), (gemma, [gemma])):
        f32 = work / f"{source.stem}-F32.gguf"
        _run([quantize, "--allow-requantize", str(source), str(f32), "F32", str(threads)])
        base = work / f"{source.stem}.kld"
        common = ["-c", str(window), "-b", str(window), "-t", str(threads)]
        _run(
            [str(ppl), "-m", str(f32), "-f", str(TEXT), *common, "--kl-divergence-base", f"{base}"]
        )
        n_ctx, _, chunks = _kld_base(base)
        bos = _bos(f32)
        fed = [[bos, *c[1:]] if bos is not None else c for c in chunks]
        first = n_ctx // 2
        reference = kiln_scorer(f32, {}, work)
        ref_lps = [torch.log_softmax(reference(c)[first:-1].double(), -1) for c in fed]
        ref_nll = sum(
            -lp.gather(1, torch.tensor(c[first + 1 :])[:, None]).sum().item()
            for lp, c in zip(ref_lps, chunks, strict=True)
        )
        positions = len(chunks) * (n_ctx - 1 - first)
        for v in variants:
            kiln = {}
            for tag, flags in (("", {}), (" +a8", A8)):
                score = kiln_scorer(v, flags, work)
                kl = top = 0.0
                for lp, c in zip(ref_lps, fed, strict=True):
                    got = torch.log_softmax(score(c)[first:-1].double(), -1)
                    kl += (lp.exp() * (lp - got)).sum().item()
                    top += (lp.argmax(-1) == got.argmax(-1)).sum().item()
                kiln[tag] = (kl / positions, top / positions)
            out = _run(
                [
                    str(ppl),
                    "-m",
                    str(v),
                    *common,
                    "--kl-divergence-base",
                    str(base),
                    "--kl-divergence",
                ]
            )
            l_kl, l_top = _llama_kld(out)
            rows.append(
                f"| {v.stem} | {kiln[''][0]:.5f} | {kiln[' +a8'][0]:.5f} | {l_kl:.5f} | "
                f"{kiln[''][1]:.2%} | {kiln[' +a8'][1]:.2%} | {l_top:.2%} | "
                f"{math.exp(ref_nll / positions):.3f} |"
            )
    print("\n## Quality on GGUF K-quant files: each runtime against its own F32 logits")
    print(
        f"{TEXT.name}, chunks of {window} tokens as llama-perplexity cuts them, the second half "
        "of each scored\n"
    )
    print(
        "| file | kiln mean KL | kiln +a8 mean KL | llama.cpp mean KL | kiln top-1 same | "
        "kiln +a8 top-1 same | llama.cpp top-1 same | F32 perplexity (kiln) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=512, help="tokens scored together")
    p.add_argument("--no-llama-cpp", action="store_true", help="kiln's variants only")
    p.add_argument(
        "--llama-perplexity",
        type=Path,
        help="score the GGUF K-quant files with kiln and this llama-perplexity instead",
    )
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.llama_perplexity:
        k_quant_quality(args.llama_perplexity, args.window, args.threads)
        return

    from transformers import AutoTokenizer

    from kiln.example import fetch

    gguf = fetch("smollm2")
    work = Path(tempfile.mkdtemp(prefix="kiln-quality-"))
    scorers = {name: kiln_scorer(gguf, flags, work) for name, flags in KILN.items()}
    tok_dir = next(work.glob("art-*")) / "tokenizer"
    ids = AutoTokenizer.from_pretrained(tok_dir)(TEXT.read_text())["input_ids"]
    windows = [ids[i : i + args.window] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    if not args.no_llama_cpp:
        try:
            files = llama_cpp_files(gguf, work)
            for name, path in files.items():
                scorers[name] = llama_cpp_scorer(path, args.window)
            # kiln on the same Q4_0 / Q8_0 files: the same weights, kiln's fp32 activations
            # or (--quantize-activations int8) int8 ones per block of 32, as llama.cpp's
            for q in ("Q4_0", "Q8_0"):
                for suffix, flags in (("", {}), (", int8 activations", A8)):
                    scorers[f"kiln on llama.cpp's {q} file{suffix}"] = kiln_scorer(
                        files[f"llama.cpp {q}"], flags, work
                    )
        except ImportError:
            print("llama-cpp-python is not installed: llama.cpp rows left out")

    ref_name = next(iter(KILN))
    totals = {name: [0.0, 0.0, 0.0] for name in scorers}
    positions = 0
    for w in windows:
        ref = scorers[ref_name](w)
        positions += len(w) - 1
        for name, score in scorers.items():
            for i, v in enumerate(metrics(ref, score(w), w)):
                totals[name][i] += v

    print(f"\n## Quality: SmolLM2-135M-Instruct, {len(ids)} tokens of {TEXT.name}")
    print(f"{len(windows)} windows of up to {args.window} tokens; reference: {ref_name}\n")
    print("| variant | perplexity | mean KL vs reference | top-1 agreement |")
    print("| --- | --- | --- | --- |")
    for name, (nll, kl, top1) in totals.items():
        print(
            f"| {name} | {math.exp(nll / positions):.3f} | {kl / positions:.5f} | "
            f"{top1 / positions:.2%} |"
        )


if __name__ == "__main__":
    main()
