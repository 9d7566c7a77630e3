"""The content-addressed cache key of a compile, computed without torch.

Key = sha256 of the factors below, all of which are stored in the manifest so a miss can be
explained factor by factor. Contents, not paths: the checkpoint's config, weight files and
tokenizer files by sha256; the compile-time arguments resolved (`--dtype auto` and the dtype
it resolves to are one key; paths and the checkpoint folder's name are not factors); the
target; the C compiler and flags of the native kernels; kiln's version and the sha256 of its
compiler, pass, model and kernel sources (Python and C); torch's version.

Hashing a multi-GB checkpoint takes seconds per GB, so a file's hash is remembered by
(resolved path, size, mtime_ns, inode) in the cache (`hashes/`), as git's index does: an
unchanged file is not read again. A file rewritten in place within one mtime tick with the
same size would be missed, as by git; `kiln cache key --rehash` reads every file again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.args import ArgError, ServerArgs, json_object
from kiln.compiler.ckpt_files import find_gguf, resolve_format, weight_files
from kiln.core import artefact as fmt
from kiln.core.target import Target, TargetError
from kiln.core.target import resolve as resolve_target
from kiln.kernels import native
from kiln.paths import cache_dir
from kiln.version import __version__

DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
# Float dtypes kiln's CPU kernels run at full speed: fp32 today. A bf16 kernel set for
# targets with native bf16 dot products would make `auto` keep bf16 checkpoints in bf16.
CPU_FAST_DTYPES = ("float32",)
# Compile-time arguments that name inputs rather than shape the artefact: their contents
# are factors instead (a Hub revision picks the files whose contents are hashed).
_PATH_ARGS = (
    "model_path",
    "tokenizer_path",
    "quantization_param_path",
    "speculative_draft_model_path",
    "revision",
    "speculative_draft_model_revision",
)
# The compile arguments a STANDALONE draft model's own compile takes from the model's: the
# target, and what the KV pool and pages must agree on.
DRAFT_INHERITS = ("device", "target_isa", "page_size", "kv_cache_dtype")
# The algorithms whose draft (a model, an EAGLE head) is a factor of the key.
DRAFTING = ("STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
# The packages whose source decides what an artefact holds.
_SOURCE_PACKAGES = (
    *("kiln", "kiln.args", "kiln.compiler", "kiln.kernels", "kiln.models", "kiln.passes"),
    # The IR, the op definitions, the quantization maths and the weight layouts.
    *("kiln.core", "kiln.core.ops"),
)


def resolve_dtype(requested: str, checkpoint_dtype: str, target: Target) -> str:
    """--dtype auto. CUDA: SGLang's rule (BF16 checkpoints stay BF16, FP32 and FP16 become
    FP16). CPU (a kiln deviation): the fastest float kiln's kernels for the target run at
    full accuracy, which today is fp32 (fp16 and bf16 run on the slower reference kernels)."""
    if requested != "auto":
        return DTYPE_NAMES[requested]
    if target.device == "cpu":
        return checkpoint_dtype if checkpoint_dtype in CPU_FAST_DTYPES else "float32"
    return "bfloat16" if checkpoint_dtype == "bfloat16" else "float16"


@dataclass(frozen=True)
class CompileKey:
    """The key and everything it was computed from, resolved once for the compile."""

    key: str
    factors: dict[str, Any]
    checkpoint: Path
    # None: the tokenizer comes from the checkpoint file itself (GGUF).
    tokenizer_dir: Path | None
    target: Target
    dtype: str
    load_format: str
    toolchain: native.Toolchain | None


def model_overrides(args: ServerArgs) -> dict[str, Any]:
    """--json-model-override-args as the fields it sets in the checkpoint's config (SGLang's
    meaning: each top-level key replaces the config's, a nested value whole). Data only:
    the fields feed the model definition's reading of the config, as config.json's do."""
    return json_object("--json-model-override-args", args.json_model_override_args or "{}")


def compile_key(args: ServerArgs, rehash: bool = False) -> CompileKey:
    """The cache key of compiling `args`; ArgError names the flag when an input is wrong."""
    if not args.model_path:
        raise ArgError("--model-path: required (the Hugging Face checkpoint folder)")
    ckpt = Path(args.model_path)
    if not ckpt.exists():
        raise ArgError(f"--model-path: {ckpt} does not exist")
    gguf = args.load_format == "gguf" or find_gguf(ckpt) is not None
    if ckpt.is_dir() and not (ckpt / "config.json").is_file() and not gguf:
        raise ArgError(f"--model-path: {ckpt} has no config.json (not a Hugging Face checkpoint)")
    load_format = resolve_format(ckpt, args.load_format)
    overrides = model_overrides(args)
    try:
        target = resolve_target(args.device, args.target_isa)
    except TargetError as e:
        raise ArgError(str(e)) from None
    if load_format == "gguf":
        # One file holds config, tokenizer and tensors; it is hashed as the weights. Its
        # tensors are read as float32 (dequantized) unless --dtype asks for less.
        config = None
        tok_dir = Path(args.tokenizer_path) if args.tokenizer_path else None
        ckpt_dtype = "float32"
    else:
        if not ckpt.is_dir():
            raise ArgError(f"--model-path: {ckpt} is not a folder or a .gguf file")
        config = ckpt / "config.json"
        if not config.is_file():
            raise ArgError(
                f"--model-path: {ckpt} has no config.json (not a Hugging Face checkpoint)"
            )
        tok_dir = Path(args.tokenizer_path) if args.tokenizer_path else ckpt
        try:
            cfg = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArgError(f"--model-path: {config} is not valid JSON: {e}") from None
        cfg = {**cfg, **overrides}
        ckpt_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    dtype = resolve_dtype(args.dtype, ckpt_dtype, target)
    toolchain = native.Toolchain.find() if target.device == "cpu" else None

    hashed = functools.partial(file_sha256, rehash=rehash)
    files = [] if load_format == "dummy" else weight_files(ckpt, load_format)[0]
    tok_files = (
        []
        if tok_dir is None
        else [tok_dir / n for n in fmt.TOKENIZER_FILES if (tok_dir / n).is_file()]
    )
    resolved = {"dtype": dtype, "device": target.device, "target_isa": target.isa}
    if load_format == "gguf" and args.dtype == "auto" and not args.torchao_config:
        # A GGUF file's blocks run as stored unless a float dtype is asked for: `auto` and
        # `--quantization gguf` are one compile, an explicit --dtype another.
        resolved["quantization"] = args.quantization or "gguf"
    factors = {
        "format_version": fmt.FORMAT_VERSION,
        "kiln_version": __version__,
        "kiln_source_sha256": source_sha256(),
        "torch_version": importlib.metadata.version("torch"),
        "compile_args": {**canonical_args(args), "load_format": load_format, **resolved},
        "target": target.to_json(),
        # The C compiler and its flags make the native kernels (the source is in kiln's).
        "native_toolchain": None
        if toolchain is None
        else {
            "compiler": toolchain.version,
            "flags": list(native.library_flags(target, toolchain)),
        },
        "config_sha256": None if config is None else hashed(config),
        # By file name inside the checkpoint folder (a .gguf file is its own folder).
        "weights_sha256": {
            f.name if ckpt.is_file() else str(f.relative_to(ckpt)): hashed(f) for f in files
        },
        "tokenizer_sha256": {f.name: hashed(f) for f in tok_files},
        # The KV cache scales file (--quantization-param-path) by its content.
        "kv_scales_sha256": _scales_sha256(args, hashed),
    }
    if args.speculative_algorithm in DRAFTING and args.speculative_draft_model_path:
        # The draft model by its own key (its files' content, not its path).
        factors["speculative_draft"] = compile_key(draft_args(args), rehash).key
    key = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()
    return CompileKey(key, factors, ckpt, tok_dir, target, dtype, load_format, toolchain)


def draft_args(args: ServerArgs, int8_activations: bool = True) -> ServerArgs:
    """A STANDALONE draft model's compile arguments: its checkpoint, the model's target and
    KV settings (DRAFT_INHERITS), the model's --quantize-activations when it has one, else
    int8 activations (tried first; a float draft compiles without them)."""
    if not args.speculative_draft_model_path:
        raise ArgError("--speculative-algorithm STANDALONE: needs --speculative-draft-model-path")
    path = Path(args.speculative_draft_model_path)
    if not path.exists():
        raise ArgError(f"--speculative-draft-model-path: {path} does not exist")
    values = {k: getattr(args, k) for k in DRAFT_INHERITS}
    activations = args.quantize_activations
    if activations == "none" and int8_activations:
        activations = "int8"
    return ServerArgs(model_path=str(path), quantize_activations=activations, **values)


def _scales_sha256(args: ServerArgs, hashed: Any) -> str | None:
    if not args.quantization_param_path:
        return None
    path = Path(args.quantization_param_path)
    if not path.is_file():
        raise ArgError(f"--quantization-param-path: {path} is not a file")
    return str(hashed(path))


def canonical_args(args: ServerArgs) -> dict[str, Any]:
    """The compile-time arguments as values (aliases already folded by ServerArgs), without
    the paths, JSON-friendly."""
    values = args.stage_values("compile")
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if k not in _PATH_ARGS
    }


def source_files() -> list[tuple[str, Path]]:
    """(package-relative name, path) of kiln's own sources that decide what an artefact
    holds, found without importing them."""
    out = []
    for pkg in _SOURCE_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations is not None
        root = Path(next(iter(spec.submodule_search_locations)))
        files = [p for p in root.glob("*") if p.suffix in (".py", ".c", ".h")]
        if (root / "csrc").is_dir():
            files += [p for p in (root / "csrc").glob("*") if p.suffix in (".c", ".h")]
        out += [(f"{pkg}/{f.relative_to(root)}", f) for f in sorted(files)]
    return out


@functools.cache
def source_sha256() -> str:
    """The hash of `source_files` (a development build with another pass, op rule or
    kernel is another compiler)."""
    h = hashlib.sha256()
    for name, f in source_files():
        h.update(name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def file_sha256(path: Path, rehash: bool = False) -> str:
    """sha256 of a file, remembered by (path, size, mtime_ns, inode) under the cache."""
    st = path.stat()
    stamp = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    memo = cache_dir() / "hashes" / hashlib.sha256(stamp.encode()).hexdigest()[:40]
    if not rehash:
        try:
            known = memo.read_text()
            if len(known) == 64:
                return known
        except OSError:
            pass
    digest = fmt.sha256_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache only costs the hashing next time
    return digest
