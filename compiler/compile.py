"""The compile driver: checkpoint -> trace -> passes -> artefact, through the cache."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

import kiln
from kiln.args import ArgError, ServerArgs
from kiln.compiler import artefact as fmt
from kiln.compiler.checkpoint import CheckpointReader
from kiln.compiler.ir import STRUCTURAL_OPS, Graph
from kiln.compiler.layout import pack_panels, panel_shape
from kiln.compiler.publish import publish, staging_dir
from kiln.compiler.target import Target, TargetError
from kiln.compiler.target import resolve as resolve_target
from kiln.compiler.trace import trace
from kiln.kernels import native
from kiln.models import ModelConfig, build
from kiln.passes import PIPELINES, PassContext, run_passes

log = logging.getLogger("kiln.compile")

_DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


@dataclass(frozen=True)
class CompileResult:
    path: Path
    cache_key: str
    cache_hit: bool
    seconds: float
    target: str = ""  # what was compiled for, and in which dtype (said in the CLI's output)
    dtype: str = ""


# Float dtypes kiln's CPU kernels run at full speed: fp32 today. A bf16 kernel set for
# targets with native bf16 dot products would make `auto` keep bf16 checkpoints in bf16.
CPU_FAST_DTYPES = ("float32",)


def resolve_dtype(requested: str, checkpoint_dtype: str, target: Target) -> str:
    """--dtype auto. CUDA: SGLang's rule (BF16 checkpoints stay BF16, FP32 and FP16 become
    FP16). CPU (a kiln deviation): the fastest float kiln's kernels for the target run at
    full accuracy, which today is fp32 (fp16 and bf16 run on the slower reference kernels)."""
    if requested != "auto":
        return _DTYPE_NAMES[requested]
    if target.device == "cpu":
        return checkpoint_dtype if checkpoint_dtype in CPU_FAST_DTYPES else "float32"
    return "bfloat16" if checkpoint_dtype == "bfloat16" else "float16"


def compile_model(args: ServerArgs, out: str | Path) -> CompileResult:
    """Compile `args.model_path` into an artefact at `out`; a cache hit returns at once."""
    t0 = time.perf_counter()
    if not args.model_path:
        raise ArgError("--model-path: required (the Hugging Face checkpoint folder)")
    ckpt = Path(args.model_path)
    if not ckpt.is_dir():
        raise ArgError(f"--model-path: {ckpt} is not a folder")
    out = Path(out)
    tok_dir = Path(args.tokenizer_path) if args.tokenizer_path else ckpt
    cfg = ModelConfig.from_hf(ckpt)
    try:
        target = resolve_target(args.device, args.target_isa)
    except TargetError as e:
        raise ArgError(str(e)) from None
    dtype = resolve_dtype(args.dtype, cfg.torch_dtype, target)
    toolchain = _toolchain(target)

    with CheckpointReader(ckpt, args.load_format) as reader:
        factors = _cache_factors(args, ckpt, tok_dir, reader, dtype, target, toolchain)
        key = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()
        if _is_hit(out, key, factors):
            return CompileResult(out, key, True, time.perf_counter() - t0, str(target), dtype)

        graph, constants = trace(build(cfg))
        for spec in graph.weights.values():
            if "load" in spec.source:
                spec.dtype = dtype
        backends = {"attention": args.attention_backend} if args.attention_backend else {}
        options = {"backends": backends, "native_kernels": toolchain is not None}
        ctx = PassContext(target=target, dtype=dtype, options=options)
        graph, pass_log = run_passes(graph, ctx, PIPELINES["default"])
        uses_native = any(
            n.meta.get("backend") == "kiln_cpu" for n in graph.nodes if n.op not in STRUCTURAL_OPS
        )

        tmp = staging_dir(out)
        try:
            try:
                built = None
                if uses_native:
                    assert toolchain is not None
                    built = _native_build(target, toolchain, tmp)
                _write_weights(tmp / fmt.WEIGHTS, graph, reader, constants)
                (tmp / fmt.GRAPH).write_text(graph.dumps())
                _copy_tokenizer(tok_dir, tmp / fmt.TOKENIZER_DIR)
                manifest = _manifest(args, cfg, graph, tmp, dtype, target, key, factors, pass_log)
                manifest["native"] = built
                (tmp / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))
            except (OSError, SafetensorError) as e:
                raise fmt.ArtefactError(f"-o {out}: cannot write the artefact: {e}") from None
            publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return CompileResult(out, key, False, time.perf_counter() - t0, str(target), dtype)


def _toolchain(target: Target) -> native.Toolchain | None:
    """The C compiler that builds kiln_cpu for a CPU target; None (with one warning) where
    there is none: the artefact then runs torch's reference kernels everywhere."""
    if target.device != "cpu":
        return None
    toolchain = native.Toolchain.find()
    if toolchain is None:
        log.warning(
            "no C compiler (%s): kiln's CPU kernels are not built, the artefact runs the "
            "slower reference kernels; install gcc and recompile for the fast path",
            native.compiler_command(),
        )
    return toolchain


def _native_build(target: Target, toolchain: native.Toolchain, root: Path) -> dict[str, Any]:
    """Build (or take from the kernel store) the library for `target`, copy it into the
    artefact and describe it for the manifest."""
    try:
        lib = native.build(target, toolchain)
    except native.KernelBuildError as e:
        raise ArgError(f"--target-isa {target.isa}: {e}") from None
    dst = root / fmt.NATIVE_LIB
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lib, dst)
    lanes, group = panel_shape(target)
    return {
        "file": fmt.NATIVE_LIB,
        "build_id": native.build_id(target, toolchain),
        "sha256": fmt.sha256_file(dst),
        "source_sha256": native.source_sha256(),
        "flags": list(native.flags(target)),
        "compiler": toolchain.version,
        "lanes": lanes,
        "group_panels": group,
    }


def _is_hit(out: Path, key: str, factors: dict[str, Any]) -> bool:
    try:
        old = fmt.read_manifest(out)
    except fmt.ArtefactError:
        return False
    if old.get("cache_key") != key:
        log.info("cache miss at %s: %s differ", out, ", ".join(explain_miss(old, factors)))
        return False
    try:
        fmt.verify_files(out, old)
    except fmt.ArtefactError as e:
        log.warning("cache entry at %s is damaged (%s); recompiling", out, e)
        return False
    return True


def explain_miss(old_manifest: dict[str, Any], factors: dict[str, Any]) -> list[str]:
    """The cache factors (one level into compile_args) that differ from an old artefact."""
    old = old_manifest.get("cache_factors", {})
    changed = []
    for k, v in factors.items():
        if k == "compile_args" and isinstance(old.get(k), dict):
            changed += [
                f"compile_args.{a}"
                for a in sorted(set(v) | set(old[k]))
                if v.get(a) != old[k].get(a)
            ]
        elif old.get(k) != v:
            changed.append(k)
    return changed


def _hash_files(files: list[Path], root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): fmt.sha256_file(f) for f in files}


def _cache_factors(
    args: ServerArgs,
    ckpt: Path,
    tok_dir: Path,
    reader: CheckpointReader,
    dtype: str,
    target: Target,
    toolchain: native.Toolchain | None,
) -> dict[str, Any]:
    """Everything the artefact depends on; stored whole so a miss can be explained."""
    tok_files = [tok_dir / n for n in fmt.TOKENIZER_FILES if (tok_dir / n).is_file()]
    return {
        "format_version": fmt.FORMAT_VERSION,
        "kiln_version": kiln.__version__,
        "kiln_source_sha256": _source_hash(),
        "torch_version": torch.__version__,
        "compile_args": _portable_args(args),
        "resolved": {"dtype": dtype, "device": target.device},
        "target": target.to_json(),
        # The C compiler and its flags make the native kernels (the source is in kiln's).
        "native_toolchain": None
        if toolchain is None
        else {"compiler": toolchain.version, "flags": list(native.flags(target))},
        "config_sha256": fmt.sha256_file(ckpt / "config.json"),
        "weights_sha256": {}
        if reader.load_format == "dummy"
        else _hash_files(list(reader.iter_files()), ckpt),
        "tokenizer_sha256": _hash_files(tok_files, tok_dir),
    }


@functools.cache
def _source_hash() -> str:
    """The code that decides what an artefact holds (models, IR, passes, kernels, args):
    a development build of kiln with another pass or kernel rule is another toolchain."""
    import kiln.args
    import kiln.compiler
    import kiln.kernels
    import kiln.models
    import kiln.passes

    h = hashlib.sha256()
    for pkg in (kiln.args, kiln.compiler, kiln.kernels, kiln.models, kiln.passes):
        root = Path(str(pkg.__file__)).parent
        for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _portable_args(args: ServerArgs) -> dict[str, Any]:
    # Paths are inputs, not properties of the artefact: their content is hashed instead.
    values = args.stage_values("compile")
    for name in ("model_path", "tokenizer_path"):
        if values.get(name):
            values[name] = Path(values[name]).name
    # JSON-friendly: tuples (list flags) as lists.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _materialise(
    src: dict[str, Any], reader: CheckpointReader, constants: dict[str, torch.Tensor]
) -> torch.Tensor:
    if "load" in src:
        return reader.get(src["load"], tuple(src["shape"]))
    if "constant" in src:
        return constants[src["constant"]]
    if "concat" in src:
        parts = [_materialise(s, reader, constants) for s in src["concat"]]
        return torch.cat(parts, dim=src["dim"])
    raise ValueError(f"unknown weight recipe {src}")


def _write_weights(
    path: Path, graph: Graph, reader: CheckpointReader, constants: dict[str, torch.Tensor]
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(graph.weights.items(), desc="weights", unit="tensor", disable=None, leave=False)
    for name, spec in bar:
        t = _materialise(spec.source, reader, constants)
        dtype = getattr(torch, spec.dtype)
        t = t.to(dtype).contiguous()
        if tuple(t.shape) != spec.shape:
            raise ValueError(
                f"weight {name}: built shape {tuple(t.shape)}, graph wants {spec.shape}"
            )
        tensors[name] = t if spec.layout == "rows" else pack_panels(t, spec.layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt", "producer": "kiln"})


def _copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    copied = [n for n in fmt.TOKENIZER_FILES if (src / n).is_file()]
    for n in copied:
        shutil.copy2(src / n, dst / n)
    if not copied:
        log.warning("no tokenizer files in %s: the artefact will take token ids only", src)


def _eos_ids(cfg: ModelConfig, tok_dir: Path) -> list[int]:
    ids = list(cfg.eos_token_ids)
    gen = tok_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and e not in ids:
                ids.append(int(e))
    return ids


def _manifest(
    args: ServerArgs,
    cfg: ModelConfig,
    graph: Graph,
    root: Path,
    dtype: str,
    target: Target,
    key: str,
    factors: dict[str, Any],
    pass_log: list[dict[str, Any]],
) -> dict[str, Any]:
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return {
        "format_version": fmt.FORMAT_VERSION,
        "kiln_version": kiln.__version__,
        "torch_version": torch.__version__,
        "target": target.to_json(),
        "model": cfg.to_dict(),
        # What the runtime needs to know about the model, without reading `model`.
        "runtime": {
            "num_layers": cfg.num_layers,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.max_position_embeddings,
            "dtype": dtype,
            "page_size": args.page_size,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_ids": _eos_ids(cfg, root / fmt.TOKENIZER_DIR),
            "served_model_name": Path(args.model_path or "model").name,
        },
        "compile_args": factors["compile_args"],
        "cache_key": key,
        "cache_factors": factors,
        "passes": pass_log,
        "files": {rel: fmt.file_entry(root, rel) for rel in files},
    }
