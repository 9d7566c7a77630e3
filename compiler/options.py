"""The compile options (passes/options.py CompileOptions), built once from the server
arguments, the compile key (target, dtype, C compiler) and the checkpoint's facts. Every
flag error of a compile is raised here, naming the flag; the passes trust what they get.

- tensor parallelism (`--tp-size`, `--ep-size`): what the model's shapes allow;
- quantization (`--quantization`, `--torchao-config`, `--quantize-activations`, or a
  checkpoint stored quantized) and the groups each rank's inputs must hold whole;
- the KV pool (`--kv-cache-dtype`, `--quantization-param-path`): the element type and
  per-layer scales attention stores it with (stored = value / scale, read = stored * scale).
  The scales file has the layout vLLM's and SGLang's calibration tools write:
  {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp rank>": {"<layer>": s}}}};
  kiln compiles for one rank, so it reads rank "0"'s, one positive scale for every layer;
- the capture plan (SGLang's CUDA-graph and torch.compile flags): decode batch-size and
  prefill token buckets (passes/capture_plan.py records them with the graph's split points).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from kiln.args import ArgError, ServerArgs
from kiln.compiler.checkpoint import CheckpointReader
from kiln.compiler.key import CompileKey
from kiln.core.artefact import MAX_DRAFT_TOKENS, MAX_NGRAM_WINDOW, MAX_SPECULATIVE_BATCH
from kiln.core.quant import FORMATS
from kiln.core.target import Target
from kiln.models import ModelConfig
from kiln.passes.options import Capture, CompileOptions, KVCache, Quantization, TensorParallel

log = logging.getLogger("kiln.compile")

# --torchao-config -> (format, group): int8 weight-only, 4-bit with a scale and a min per G.
TORCHAO = {"int8wo": ("int8", 0), **{f"int4wo-{g}": ("uint4", g) for g in (32, 64, 128, 256)}}
NO_GPU_MAX_BS = 160  # SGLang's cuda_graph_max_bs when it sees no GPU
DEFAULT_DRAFT_STEPS = 3  # --speculative-num-steps unset with a draft model
# The algorithms that draft with a model of their own (--speculative-draft-model-path), and
# of those, the EAGLE heads that read the model's hidden states (models/eagle.py).
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
DRAFT_MODEL_ALGORITHMS = ("STANDALONE", *EAGLE_ALGORITHMS)


def speculative_algorithm(args: ServerArgs) -> str | None:
    """--speculative-algorithm as it runs: NEXTN is EAGLE (SGLang's alias)."""
    algorithm = args.speculative_algorithm
    return "EAGLE" if algorithm == "NEXTN" else algorithm


def compile_options(
    args: ServerArgs, key: CompileKey, reader: CheckpointReader, cfg: ModelConfig
) -> CompileOptions:
    """The passes' options for this compile (rank 0's; `for_rank` gives the others)."""
    target = key.target
    tp = tensor_parallel(args, cfg)
    scheme = quant_scheme(args, target, reader)
    if scheme is not None:
        check_groups(scheme, cfg, tp.size)
    speculative = speculative_options(args)
    hidden_states_options(args, speculative, tp.size)
    return CompileOptions(
        target=target,
        dtype=key.dtype,
        native_kernels=key.toolchain is not None,
        attention_backend=args.attention_backend,
        prefill_attention_backend=args.prefill_attention_backend,
        decode_attention_backend=args.decode_attention_backend,
        quantization=scheme,
        kv_cache=kv_cache_options(args, cfg.num_layers),
        capture=capture_options(args, target, tp.size, speculative),
        tp=tp,
        speculative=speculative,
        deterministic=deterministic_options(args, target),
        fp32_lm_head=bool(args.enable_fp32_lm_head),
    )


def hidden_states_options(
    args: ServerArgs, speculative: dict[str, Any] | None, tp_size: int = 1
) -> None:
    """--enable-return-hidden-states and EAGLE's heads: the steps' second output, which a
    verify step (the first's), an embedding model's pooled output and a recorded step (CUDA
    graphs, compiled pieces) have no place for; EAGLE's heads run at --tp-size 1 for now."""
    eagle = speculative is not None and speculative["algorithm"] in EAGLE_ALGORITHMS
    if not args.enable_return_hidden_states and not eagle:
        return
    flag = (
        f"--speculative-algorithm {args.speculative_algorithm}"
        if eagle
        else "--enable-return-hidden-states"
    )
    clash = (
        "--speculative-algorithm" if speculative and not eagle
        else "--enable-return-hidden-states" if eagle and args.enable_return_hidden_states
        else "--is-embedding" if args.is_embedding
        else "--enable-torch-compile" if args.enable_torch_compile
        else "--enable-piecewise-cuda-graph" if args.enable_piecewise_cuda_graph
        else f"--tp-size {tp_size} (EAGLE heads run at 1 for now)" if eagle and tp_size > 1
        else None
    )  # fmt: skip
    if clash is not None:
        raise ArgError(f"{flag}: not with {clash}")


def deterministic_options(args: ServerArgs, target: Target) -> bool:
    """--enable-deterministic-inference: on CPU targets the lowered C step's batch-invariant
    attention and linears (passes/deterministic.py), on CUDA targets the batch-invariant
    kernels (passes/select_backends.py). Inductor's generated code is neither."""
    if args.enable_deterministic_inference and args.enable_torch_compile:
        raise ArgError(
            "--enable-deterministic-inference: --enable-torch-compile's generated kernels "
            "are not batch-invariant; leave one of the two out"
        )
    return bool(args.enable_deterministic_inference)


def tensor_parallel(args: ServerArgs, cfg: ModelConfig) -> TensorParallel:
    """--tp-size / --ep-size against what the model's shapes can be split into."""
    size, ep = args.tp_size, args.ep_size
    if ep not in (1, size):
        raise ArgError(
            f"--ep-size {ep}: kiln runs expert parallelism over the tensor-parallel ranks: "
            f"--ep-size 1 or equal to --tp-size ({size})"
        )
    if size == 1:
        return TensorParallel()
    kv = cfg.num_kv_heads
    whole = [("num_attention_heads", cfg.num_heads), ("vocab_size", cfg.vocab_size)]
    if not all(cfg.sparse_layers) or not cfg.sparse_layers:
        whole.append(("MLP intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        whole.append(
            ("num_experts (--ep-size)", cfg.num_experts)
            if ep > 1
            else ("moe_intermediate_size", cfg.moe_intermediate_size)
        )
    for what, total in whole:
        if total % size:
            raise ArgError(f"--tp-size {size}: {what} {total} is not divisible by {size}")
    if kv % size and size % kv:
        raise ArgError(
            f"--tp-size {size}: num_key_value_heads {kv} neither divides by nor divides {size}"
        )
    return TensorParallel(size, 0, ep > 1)


def check_groups(scheme: Quantization, cfg: ModelConfig, tp: int) -> None:
    """Every quantized linear's inputs, as a rank holds them, are whole groups: the
    hidden size; and, cut by --tp-size, the attention output and the MLP's width."""
    group = scheme.group
    if scheme.int8_activations:
        for name, (fmt, stored) in (scheme.stored or {}).items():
            step = FORMATS[FORMATS[fmt].int8_activations or fmt].group_step
            if stored and stored % step:
                raise ArgError(
                    f"--quantize-activations int8: {name} has groups of {stored} inputs, and "
                    f"{FORMATS[fmt].int8_activations} needs a multiple of {step}"
                )
    if scheme.format is None or not group:
        return
    inputs = {
        "hidden_size": cfg.hidden_size,
        "the attention output": cfg.num_heads * cfg.head_dim // tp,
        "the MLP width": (cfg.moe_intermediate_size or cfg.intermediate_size) // tp,
    }
    if cfg.sparse_layers and not all(cfg.sparse_layers):
        inputs["the dense MLP width"] = cfg.intermediate_size // tp
    for what, k in inputs.items():
        if k % group:
            if tp > 1 and what != "hidden_size":
                raise ArgError(
                    f"--tp-size {tp}: each rank's {k} inputs of {what} are not whole "
                    f"quantization groups of {group}; choose a --tp-size (or a group) that "
                    "divides them"
                )
            raise ArgError(
                f"{scheme.flag}: group {group} does not divide the {k} inputs of {what}; "
                "choose a group that does"
            )


def speculative_options(args: ServerArgs) -> dict[str, Any] | None:
    """--speculative-* as the manifest records them (kiln.core.artefact.Speculative), with
    SGLang's NGRAM default for --speculative-num-draft-tokens; None without speculation."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        return None
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= MAX_NGRAM_WINDOW:
        raise ArgError(f"--speculative-ngram-min-match-window-size: {lo}; 1 to {MAX_NGRAM_WINDOW}")
    if not lo <= hi <= MAX_NGRAM_WINDOW:
        raise ArgError(
            f"--speculative-ngram-max-match-window-size: {hi}; from "
            f"--speculative-ngram-min-match-window-size ({lo}) to {MAX_NGRAM_WINDOW}"
        )
    branch = args.speculative_ngram_branch_length
    if branch < 1:
        raise ArgError(f"--speculative-ngram-branch-length: {branch}; at least 1")
    draft = args.speculative_draft_model_path
    steps = None
    topk = args.speculative_eagle_topk
    if topk is not None and topk != 1:
        raise ArgError(
            f"--speculative-eagle-topk: {topk}; kiln drafts a chain (1): a tree of drafts "
            "is not built yet"
        )
    if algorithm in DRAFT_MODEL_ALGORITHMS:
        # (EAGLE and NEXTN without one: a model's own MTP layer, if it has one: compile.py)
        if not draft and algorithm in ("STANDALONE", "EAGLE3"):
            what = "the draft model's" if algorithm == "STANDALONE" else "the EAGLE head's"
            raise ArgError(
                f"--speculative-algorithm {algorithm}: needs --speculative-draft-model-path "
                f"({what} checkpoint)"
            )
        steps = args.speculative_num_steps or DEFAULT_DRAFT_STEPS
        if not 1 <= steps < MAX_DRAFT_TOKENS:
            raise ArgError(f"--speculative-num-steps: {steps}; 1 to {MAX_DRAFT_TOKENS - 1}")
        tokens = steps + 1
        asked = args.speculative_num_draft_tokens
        if asked is not None and asked != tokens:
            log.warning(
                "--speculative-num-draft-tokens %d is set to --speculative-num-steps + 1 = %d "
                "(a chain: --speculative-eagle-topk 1), as SGLang does",
                asked,
                tokens,
            )
    else:
        if draft:
            raise ArgError(
                f"--speculative-draft-model-path: only with --speculative-algorithm "
                f"{', '.join(DRAFT_MODEL_ALGORITHMS)} ({algorithm} drafts without a model)"
            )
        tokens = args.speculative_num_draft_tokens or hi
    if not 2 <= tokens <= MAX_DRAFT_TOKENS:
        raise ArgError(
            f"--speculative-num-draft-tokens: {tokens}; 2 (the last token and one drafted) "
            f"to {MAX_DRAFT_TOKENS}"
        )
    out: dict[str, Any] = {
        "algorithm": speculative_algorithm(args),
        "num_draft_tokens": tokens,
        "ngram_min_window": lo,
        "ngram_max_window": hi,
        "ngram_branch_length": branch,
    }
    if steps is not None:
        out["num_steps"] = steps
    return out


def verify_batch_sizes(buckets: list[int], speculative: dict[str, Any] | None) -> list[int]:
    """Decode buckets plus those of verify steps: b requests of num_draft_tokens rows each,
    for the batches that speculate (up to MAX_SPECULATIVE_BATCH, runtime/speculative.py)."""
    if speculative is None:
        return buckets
    rows = speculative["num_draft_tokens"]
    verify = {b * rows for b in range(1, MAX_SPECULATIVE_BATCH + 1)}
    return sorted(set(buckets) | verify)


def capture_options(
    args: ServerArgs, target: Target, tp: int, speculative: dict[str, Any] | None = None
) -> Capture:
    """The capture plan's decode and prefill parts for these flags on this target."""
    device = target.device
    bs, max_bs = args.cuda_graph_bs, args.cuda_graph_max_bs
    if device != "cuda":
        piecewise = args.enable_piecewise_cuda_graph or None
        for name, value in (
            ("--cuda-graph-bs", bs),
            ("--cuda-graph-max-bs", max_bs),
            ("--enable-piecewise-cuda-graph", piecewise),
        ):
            if value is not None:
                raise ArgError(
                    f"{name}: a {device} target captures no CUDA graphs (compile with "
                    "--device cuda, or leave it unset)"
                )
    padding = not args.disable_cuda_graph_padding
    if bs:
        buckets = _positive("--cuda-graph-bs", list(bs))
    else:
        if max_bs is None:
            sm = target.isa if device == "cuda" else None
            max_bs = (256 if tp < 4 else 512) if sm == "sm_90" else NO_GPU_MAX_BS
        if max_bs <= 0:
            raise ArgError(f"--cuda-graph-max-bs: expected a positive size, got {max_bs}")
        buckets = decode_batch_sizes(max_bs, padding)
    buckets = verify_batch_sizes(buckets, speculative)
    capture: dict[str, Any] = {"padding": padding}
    if args.enable_torch_compile:
        limit = args.torch_compile_max_bs or 32
        capture.update(decode="compiled", batch_sizes=tuple(b for b in buckets if b <= limit))
    elif device == "cuda" and not args.disable_cuda_graph and not two_outputs(args, speculative):
        # (--enable-return-hidden-states, EAGLE: a step's two outputs are not recorded; eager)
        capture.update(decode="cuda_graph", batch_sizes=tuple(buckets))
    elif device == "cpu" and not args.disable_cuda_graph and tp == 1:
        # kiln's CPU form of a captured step: every step as one native call, a prefill's
        # tokens as rows of the decode step's code (compiler/lower_step.py; compile.py falls
        # back to "eager" where it cannot lower).
        capture.update(decode="native", prefill="native")
    if args.enable_piecewise_cuda_graph:
        tokens = _token_list(args.piecewise_cuda_graph_tokens)
        if tokens is None:
            tokens = prefill_token_sizes(int(args.piecewise_cuda_graph_max_tokens or 4096))
        tokens = _positive("--piecewise-cuda-graph-tokens", tokens)
        capture.update(prefill="piecewise", tokens=tuple(tokens))
    return Capture(**capture)


def two_outputs(args: ServerArgs, speculative: dict[str, Any] | None) -> bool:
    """Whether the model's steps return hidden states besides the logits."""
    eagle = speculative is not None and speculative["algorithm"] in EAGLE_ALGORITHMS
    return bool(args.enable_return_hidden_states) or eagle


def decode_batch_sizes(max_bs: int, padding: bool) -> list[int]:
    """SGLang's decode buckets up to `max_bs` (without speculative decoding)."""
    if not padding:
        return list(range(1, max_bs + 1))
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    return [b for b in sizes if b <= max_bs]


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """SGLang's piecewise buckets of prefill tokens up to `max_tokens`."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


def _token_list(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        sizes = [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]
    except ValueError:
        raise ArgError(
            f"--piecewise-cuda-graph-tokens: expected token counts like 4,8,16, got {text!r}"
        ) from None
    return sizes


def _positive(flag: str, sizes: list[int]) -> list[int]:
    if not sizes or any(s <= 0 for s in sizes):
        raise ArgError(f"{flag}: expected positive sizes, got {sizes}")
    return sorted(set(sizes))


def quant_scheme(args: ServerArgs, target: Target, reader: CheckpointReader) -> Quantization | None:
    """The quantize pass's scheme from --quantization / --torchao-config and
    --quantize-activations (passes/quantize.py); ArgError names the flag for what kiln
    does not run."""
    scheme = _weight_scheme(args, target, reader)
    if args.quantize_activations == "none":
        return scheme
    flag = f"--quantize-activations {args.quantize_activations}"
    if scheme is None:
        raise ArgError(
            f"{flag}: needs quantized weights (a GGUF Q4_0 / Q4_1 / Q8_0 file, "
            "--torchao-config int4wo-G or int8wo, or a GPTQ / AWQ checkpoint)"
        )
    if scheme.format is not None and FORMATS[scheme.format].int8_activations is None:
        raise ArgError(f"{flag}: applies to 4- and 8-bit integer weights, not {scheme.flag}")
    return dataclasses.replace(scheme, int8_activations=True)


def _weight_scheme(
    args: ServerArgs, target: Target, reader: CheckpointReader
) -> Quantization | None:
    if args.quantization and args.torchao_config:
        raise ArgError("--quantization and --torchao-config: give one of them, not both")
    gguf = reader.gguf
    wants = args.quantization or args.torchao_config
    if wants and target.device != "cpu":
        flag = "--quantization" if args.quantization else "--torchao-config"
        raise ArgError(f"{flag} {wants}: quantized kernels exist for cpu targets only so far")
    if args.quantization == "gguf" or (gguf is not None and not wants and args.dtype == "auto"):
        if gguf is None:
            raise ArgError("--quantization gguf: the checkpoint is not a GGUF file")
        if target.device != "cpu":
            return None  # no quantized kernels for this target: the blocks are read as floats
        stored = reader.stored_formats()
        unrun = [
            gguf.qtype(n)
            for n in gguf.tensors
            if n not in stored and gguf.qtype(n) not in ("F32", "F16", "BF16")
        ]
        if unrun:
            log.warning(
                "%d tensors of %s are %s blocks, which kiln does not run as stored yet: "
                "read as floats",
                len(unrun),
                gguf.path.name,
                "/".join(sorted(set(unrun))),
            )
        return Quantization(stored=stored, flag="--quantization gguf")
    if reader.mxfp4:
        log.warning(
            "%d MXFP4 tensors (GPT-OSS experts) are dequantized at compile time: kiln has no "
            "MXFP4 kernel yet",
            len(reader.mxfp4),
        )
        if args.quantization == "mxfp4":  # SGLang's name for what the checkpoint is
            return None
    if args.quantization == "mxfp4":
        raise ArgError("--quantization mxfp4: the checkpoint has no MXFP4 tensors")
    stored_method = (
        reader.int4.method if reader.int4 else "fp8" if reader.fp8_block() is not None else None
    )
    if stored_method and not args.torchao_config:
        # A quantized checkpoint (quant_method gptq, awq or fp8) runs as stored, as SGLang
        # detects it from the config; act-order GPTQ weights are read as floats.
        if args.quantization not in (None, stored_method):
            raise ArgError(
                f"--quantization {args.quantization}: the checkpoint is {stored_method} already"
            )
        if target.device != "cpu":
            return None
        stored = reader.stored_formats()
        floats = len(reader.int4_weights()) - len(stored) if reader.int4 else 0
        if floats:
            log.warning(
                "%d %s weights have act-order groups (desc_act): kiln reads them as floats",
                floats,
                stored_method,
            )
        return Quantization(stored=stored, flag=f"a {stored_method} checkpoint")
    if args.quantization in ("gptq", "awq"):
        raise ArgError(
            f"--quantization {args.quantization}: the checkpoint has no {args.quantization} "
            "quantization_config (kiln reads GPTQ / AWQ checkpoints as they are published)"
        )
    if args.quantization == "fp8":
        return Quantization("fp8_e4m3", 0, flag="--quantization fp8")
    if args.quantization == "w8a8_int8":
        return Quantization("w8a8_int8", 0, flag="--quantization w8a8_int8")
    if args.quantization:
        raise ArgError(
            f"--quantization {args.quantization}: not implemented yet "
            "(kiln runs fp8, w8a8_int8, gguf, and gptq / awq checkpoints)"
        )
    if args.torchao_config:
        if args.torchao_config not in TORCHAO:
            raise ArgError(
                f"--torchao-config {args.torchao_config}: kiln runs {', '.join(TORCHAO)}"
            )
        fmt, group = TORCHAO[args.torchao_config]
        return Quantization(fmt, group, flag=f"--torchao-config {args.torchao_config}")
    return None


# --kv-cache-dtype -> the pool's torch dtype name (the manifest's runtime.kv_dtype).
KV_DTYPES = {"fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn"}


def kv_cache_options(args: ServerArgs, num_layers: int) -> KVCache | None:
    """The fp8 pool's dtype and per-layer scales, or None for a pool in the model's dtype;
    ArgError names the flag when the arguments or the scales file are wrong."""
    path = args.quantization_param_path
    if args.kv_cache_dtype == "auto":
        if path:
            raise ArgError(
                "--quantization-param-path: holds KV cache scales, which only "
                "--kv-cache-dtype fp8_e4m3 or fp8_e5m2 uses"
            )
        return None
    dtype = KV_DTYPES[args.kv_cache_dtype]
    if not path:
        return KVCache(dtype, (1.0,) * num_layers)
    return KVCache(dtype, tuple(read_scales(Path(path), dtype, num_layers)))


def read_scales(path: Path, dtype: str, num_layers: int) -> list[float]:
    flag = "--quantization-param-path"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgError(f"{flag}: cannot read {path}: {e}") from None
    kv = data.get("kv_cache") if isinstance(data, dict) else None
    factors = kv.get("scaling_factor") if isinstance(kv, dict) else None
    rank0 = factors.get("0") if isinstance(factors, dict) else None
    if not isinstance(rank0, dict):
        raise ArgError(f'{flag}: {path} has no kv_cache.scaling_factor for rank "0"')
    stored = kv.get("dtype") if isinstance(kv, dict) else None
    if stored not in (None, "auto", dtype):
        raise ArgError(
            f"{flag}: {path} holds scales for {stored}; --kv-cache-dtype asks for {dtype}"
        )
    extra = sorted(set(rank0) - {str(i) for i in range(num_layers)})
    if extra:
        raise ArgError(f"{flag}: {path} names layers the model lacks: {', '.join(extra[:5])}")
    scales = []
    for layer in range(num_layers):
        given = s = rank0.get(str(layer))
        if isinstance(s, bool) or not isinstance(s, int | float):
            s = math.nan
        if not (math.isfinite(s) and s > 0):
            raise ArgError(
                f"{flag}: {path}: layer {layer} has scale {given!r}; every one of the model's "
                f"{num_layers} layers needs a positive number"
            )
        scales.append(float(s))
    return scales
