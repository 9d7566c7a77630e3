"""The artefact's on-disk format, shared by the writer (compiler) and the reader (runtime).

art/
  manifest.json            versions, target, model, compile args, cache key, pass log, checksums
  graph.json               the IR after all passes (rank 0's; graph.rank{r}.json for the
                           other ranks of a tensor-parallel artefact)
  weights/rank{r}.safetensors   each rank's weights (one file when --tp-size is 1)
  tokenizer/               tokenizer files and chat template copied from the checkpoint
  kernels/cpu_kernels.so   kiln_cpu built for the target (CPU artefacts with C kernels)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

# 3: linears carry a `prologue`, rope_attention joins the ops, and the C kernels' linear
# entries take the prologue (an older artefact's graph and library would not match).
# 4: the graph records the model's context length, which the manifest's must equal; a
# manifest lists only files kiln writes.
# 5: ops are defined in kiln/core/ops (kernels take attribute objects), and an op that
# attends records a decode kernel (meta.backend) and a prefill kernel (meta.prefill_backend).
# 6: new attributes (rope_cos_sin's scaled_pairs, attention's sinks, moe's routing and
# biases), the latent attention ops, and the manifest's long_rope and v_head_dim; the C
# library's decode attention takes a soft cap and sinks (ABI 4).
# 7: attention ops and quant_linear take `deterministic` (--enable-deterministic-inference);
# the C library's decode attention takes it too (ABI 13).
FORMAT_VERSION = 7
MANIFEST = "manifest.json"
GRAPH = "graph.json"
WEIGHTS = "weights/rank0.safetensors"


def graph_file(rank: int) -> str:
    """Rank r's graph: graph.json for rank 0, graph.rank{r}.json for the others."""
    return GRAPH if rank == 0 else f"graph.rank{rank}.json"


def weights_file(rank: int) -> str:
    return f"weights/rank{rank}.safetensors"


TOKENIZER_DIR = "tokenizer"
NATIVE_LIB = "kernels/cpu_kernels.so"
# The native decode step (compiler/lower_step.py): its library and the C it was built from.
STEP_LIB = "kernels/step_decode.so"
STEP_SOURCE = "kernels/step_decode.c"

# Tokenizer-side files worth carrying; whichever of them the checkpoint has.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

# What generation_config.json may recommend for sampling (SGLang's --sampling-defaults
# model reads these).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SamplingDefaultKey = Literal["temperature", "top_p", "top_k", "min_p", "repetition_penalty"]


# The files `kiln compile` writes, and so the only ones a manifest may list.
_MEMBERS = (
    r"graph\.json|graph\.rank[1-9][0-9]{0,3}\.json|weights/rank[0-9]{1,4}\.safetensors"
    r"|kernels/cpu_kernels\.so|kernels/step_decode\.(?:so|c)|tokenizer/(?:"
    + "|".join(re.escape(n) for n in TOKENIZER_FILES)
    + ")"
)
# A STANDALONE artefact holds its draft model's artefact, whole, in DRAFT_DIR.
DRAFT_DIR = "draft"
MEMBER = re.compile(rf"(?:{DRAFT_DIR}/)?(?:{_MEMBERS})|{DRAFT_DIR}/manifest\.json")
# Bounds on the manifest's numbers, checked before anything is sized by them (each is then
# checked against the graph): far above any real model, far below what could stall a load.
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_RANKS = 1024
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 27
MAX_PAGE_SIZE = 4096
MAX_STOP_IDS = 256
MAX_NAME = 256
MAX_DRAFT_TOKENS = 64  # rows a verify step feeds one request
MAX_NGRAM_WINDOW = 64
MAX_HIDDEN = 1 << 17  # an embedding model's pooled width
MAX_MATRYOSHKA_DIMS = 64  # widths a Matryoshka model lists
MAX_LABELS = 65536  # a sequence classifier's labels
# The largest decode batch that may speculate: the runtime's bound, and the verify buckets
# (up to this many requests of num_draft_tokens rows) a CUDA capture plan records.
MAX_SPECULATIVE_BATCH = 4
_CHUNK = 1 << 22


class ArtefactError(RuntimeError):
    """The artefact is missing, damaged or made for another machine; one line says which."""


def sha256_file(path: Path, chunk: int = _CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def open_member(root: Path, rel: str) -> int:
    """A read-only descriptor of the regular file `rel` inside the artefact at `root`,
    reached without following a symbolic link at any step (a link inside an artefact could
    point anywhere on the server, /etc/passwd included). Raises ArtefactError in one line."""
    parts = PurePosixPath(rel).parts
    where = f"{root}: {rel}"
    try:
        folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ArtefactError(f"{root}: cannot open the artefact: {e.strerror}") from None
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
            os.close(folder)
            folder = inner
        # O_NONBLOCK: opening a FIFO planted in the artefact must not hang the load.
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except FileNotFoundError:
        raise ArtefactError(f"{where} is missing") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ArtefactError(
                f"{where} is a symbolic link or lies behind one; an artefact's files must "
                "be its own"
            ) from None
        raise ArtefactError(f"{where}: {e.strerror}") from None
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtefactError(f"{where} is not a regular file")
    return fd


def _hash_fd(fd: int, keep: bool) -> tuple[str, int, bytes | None]:
    h = hashlib.sha256()
    size = 0
    kept: list[bytes] = []
    with os.fdopen(fd, "rb", closefd=True) as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
            if keep:
                kept.append(block)
    return h.hexdigest(), size, b"".join(kept) if keep else None


def read_member(root: Path, rel: str, entry: dict[str, Any]) -> bytes:
    """The bytes of `rel`, a file the manifest lists as `entry`, once they match its size
    and checksum (read once, so what is checked is what is used)."""
    digest, size, data = _hash_fd(open_member(root, rel), keep=True)
    _check_entry(root, rel, entry, digest, size)
    assert data is not None
    return data


def file_entry(root: Path, rel: str) -> dict[str, Any]:
    p = root / rel
    return {"sha256": sha256_file(p), "bytes": p.stat().st_size}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FileEntry(_Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class Target(_Strict):
    device: Literal["cpu", "cuda"]
    isa: str = Field(pattern=r"^(x86-64|avx2|avx512|avx512_vnni|sm_\d{2,3})$")
    features: list[Annotated[str, Field(pattern=r"^[a-z0-9_]{1,32}$")]]


class NativeLib(_Strict):
    """The native kernel library built for the target, and how it was built."""

    file: Literal["kernels/cpu_kernels.so"]
    build_id: str = Field(pattern=r"^[0-9a-f]{20}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    source_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    flags: list[str]
    compiler: str
    lanes: Literal[8, 16]
    group_panels: int = Field(ge=1, le=8)


class NativeStep(_Strict):
    """The decode step lowered to C (compiler/lower_step.py) and built like the kernels:
    the weights its W[i] are, in order, and what the runtime checks before binding them."""

    file: Literal["kernels/step_decode.so"]
    source: Literal["kernels/step_decode.c"]
    build_id: str = Field(pattern=r"^[0-9a-f]{20}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    weights: list[Annotated[str, Field(max_length=256)]] = Field(max_length=1 << 20)
    arena_width: int = Field(gt=0, le=1 << 30)
    calls: int = Field(ge=0, le=1 << 24)


class LongRope(_Strict):
    """LongRoPE (Phi-3): the rope table weight `weight` holds the short factors' frequencies;
    serving with a context longer than `context_above` puts `inv_freq` (the long factors')
    in its place, as vLLM and llama.cpp choose by the configured context."""

    weight: str = Field(pattern=r"^[A-Za-z0-9_.]{1,64}$")
    context_above: int = Field(gt=0, le=MAX_CONTEXT)
    inv_freq: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(max_length=MAX_HEAD_DIM)


class DraftRef(_Strict):
    """The draft model of a STANDALONE artefact, or the head of an EAGLE one, whose own
    artefact is in DRAFT_DIR."""

    cache_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    # An EAGLE-3 head's draft vocabulary: the model's id of each of its logits
    hot_ids: list[Annotated[int, Field(ge=0, lt=MAX_VOCAB)]] | None = Field(
        default=None, max_length=MAX_VOCAB
    )


class Speculative(_Strict):
    """Speculative decoding as compiled (compiler/options.py, runtime/speculative.py)."""

    algorithm: Literal["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"]
    num_draft_tokens: int = Field(ge=2, le=MAX_DRAFT_TOKENS)
    num_steps: int | None = Field(default=None, ge=1, lt=MAX_DRAFT_TOKENS)
    draft: DraftRef | None = None
    ngram_min_window: int = Field(ge=1, le=MAX_NGRAM_WINDOW)
    ngram_max_window: int = Field(ge=1, le=MAX_NGRAM_WINDOW)
    ngram_branch_length: int = Field(ge=1, le=1 << 20)

    @model_validator(mode="after")
    def _windows(self) -> Speculative:
        if self.ngram_max_window < self.ngram_min_window:
            raise ValueError("ngram_max_window is below ngram_min_window")
        if (self.algorithm != "NGRAM") != (self.draft is not None):
            raise ValueError("STANDALONE and EAGLE need a draft model, NGRAM has none")
        draft = self.draft
        hot = None if draft is None else draft.hot_ids
        if (
            draft is not None
            and hot is not None
            and (self.algorithm != "EAGLE3" or max(hot, default=0) >= draft.vocab_size)
        ):
            raise ValueError("hot_ids are an EAGLE-3 head's ids in the model's vocabulary")
        return self


class RuntimeSpec(_Strict):
    """What the runtime needs to know about the model (the manifest's `runtime`). Each
    number is bounded here and then checked against the graph (runtime/artefact.py)."""

    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    num_kv_heads: int = Field(gt=0, le=MAX_HEADS)  # per tensor-parallel rank
    tp_size: int = Field(default=1, gt=0, le=MAX_RANKS)
    head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    # The V pool's width when it differs from K's: 0 for latent attention (kiln/core/ops/mla.py).
    v_head_dim: int | None = Field(default=None, ge=0, le=MAX_HEAD_DIM)
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    context_length: int = Field(gt=1, le=MAX_CONTEXT)
    dtype: Literal["float32", "float16", "bfloat16"]
    page_size: int = Field(gt=0, le=MAX_PAGE_SIZE)
    # The KV pool's element type: the model's dtype, or fp8 (--kv-cache-dtype).
    kv_dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    bos_token_id: int | None = Field(ge=0, le=MAX_VOCAB)
    eos_token_ids: list[Annotated[int, Field(ge=0, le=MAX_VOCAB)]] = Field(max_length=MAX_STOP_IDS)
    served_model_name: str = Field(min_length=1, max_length=MAX_NAME)
    long_rope: list[LongRope] = Field(default=[], max_length=2)
    speculative: Speculative | None = None
    # The checkpoint's generation_config.json's recommended sampling (range-checked by
    # the runtime's SamplingParams before use).
    sampling_defaults: dict[SamplingDefaultKey, StrictInt | StrictFloat] = {}
    # --is-embedding: the graph ends at the final norm; requests are pooled, not sampled.
    is_embedding: bool = False
    # Such a model's pooled width, and whether a request may cut it (Matryoshka): to any
    # width up to embedding_dim, or to one of matryoshka_dimensions when it lists some.
    embedding_dim: int | None = Field(default=None, gt=0, le=MAX_HIDDEN)
    matryoshka: bool = False
    matryoshka_dimensions: list[Annotated[int, Field(gt=0, le=MAX_HIDDEN)]] = Field(
        default=[], max_length=MAX_MATRYOSHKA_DIMS
    )
    # A sequence classifier's label names in id order (its pooled output: their logits)
    labels: list[Annotated[str, Field(max_length=MAX_NAME)]] = Field(
        default=[], max_length=MAX_LABELS
    )
    # --enable-return-hidden-states: the graph returns (logits, final hidden states)
    return_hidden_states: bool = False
    # EAGLE: the graph returns (logits, the hidden states its head reads, every row's)
    eagle_hidden: int = Field(default=0, ge=0, le=MAX_HIDDEN)
    # An EAGLE-3 head's logits: its draft vocabulary, where smaller than vocab_size
    logits_size: int | None = Field(default=None, gt=0, le=MAX_VOCAB)


class Manifest(_Strict):
    format_version: int
    kiln_version: str
    torch_version: str
    target: Target
    model: dict[str, Any]
    runtime: RuntimeSpec
    compile_args: dict[str, Any]
    cache_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    cache_factors: dict[str, Any]
    passes: list[dict[str, Any]]
    files: dict[str, FileEntry]
    native: NativeLib | None
    native_step: NativeStep | None = None

    @field_validator("files")
    @classmethod
    def _relative_paths(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for rel in files:
            parts = PurePosixPath(rel).parts
            if not parts or rel.startswith("/") or ".." in parts or "\\" in rel:
                raise ValueError(f"file path {rel!r} must stay inside the artefact")
            if not MEMBER.fullmatch(rel):
                raise ValueError(f"lists {rel[:80]!r}, which is not a file kiln compile writes")
        for required in (GRAPH, WEIGHTS):
            if required not in files:
                raise ValueError(f"does not list {required}")
        return files

    @model_validator(mode="after")
    def _every_rank(self) -> Manifest:
        for rank in range(self.runtime.tp_size):
            for required in (graph_file(rank), weights_file(rank)):
                if required not in self.files:
                    raise ValueError(f"does not list {required}")
        return self


def _first_problem(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "manifest"
    return f"{where}: {err['msg']}"


def compile_command(manifest: dict[str, Any], flags: str = "") -> str:
    """The `kiln compile` that makes this artefact again, for messages that name it."""
    model = manifest.get("compile_args", {}).get("model_path") or "CKPT"
    return f"kiln compile --model-path {model}{' ' + flags if flags else ''}"


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the artefact at `root`, checked against the schema; raises
    ArtefactError with one line naming the first problem."""
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtefactError(f"{root} is not a folder: expected a kiln artefact")
    if not path.is_file() and not path.is_symlink():
        raise ArtefactError(
            f"{root} has no {MANIFEST}: not a kiln artefact (make one with `kiln compile`)"
        )
    try:
        manifest = json.loads(_hash_fd(open_member(root, MANIFEST), keep=True)[2] or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtefactError(f"{path} is damaged: {e}") from e
    if not isinstance(manifest, dict):
        raise ArtefactError(f"{path} is damaged: expected a JSON object")
    version = manifest.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ArtefactError(
            f"{root}: artefact format {version!r}, this kiln reads format "
            f"{FORMAT_VERSION}; recompile with this kiln"
        )
    try:
        Manifest.model_validate(manifest)
    except ValidationError as e:
        raise ArtefactError(f"{path} is invalid: {_first_problem(e)}") from None
    return manifest


def verify_files(root: Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists: its own (no symbolic link on the way), a
    regular file, of the right size and checksum."""
    for rel, entry in manifest["files"].items():
        fd = open_member(root, rel)
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            os.close(fd)
            _check_entry(root, rel, entry, "", size)
        digest, size, _ = _hash_fd(fd, keep=False)
        _check_entry(root, rel, entry, digest, size)


class FileCheck:
    """`verify_files` on a thread, started by `kiln serve` before it imports torch: hashlib
    lets go of the GIL, so the checksums (0.44 s for a 540 MB weight file on a 2-core Xeon)
    run on the second core beside the imports instead of after them. `wait` joins it and
    raises what the check raised; it answers for `manifest` only, the dict it was given."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root, self.manifest = root, manifest
        self._error: ArtefactError | OSError | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            verify_files(self.root, self.manifest)
        except (ArtefactError, OSError) as e:
            self._error = e

    def covers(self, root: Path, manifest: dict[str, Any]) -> bool:
        """Whether this check is of `root`'s files as `manifest` lists them."""
        return self.root == root and self.manifest == manifest

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _check_entry(root: Path, rel: str, entry: dict[str, Any], digest: str, size: int) -> None:
    if size != entry["bytes"]:
        raise ArtefactError(
            f"{root}: {rel} is damaged ({size} bytes, manifest says {entry['bytes']})"
        )
    if digest != entry["sha256"]:
        raise ArtefactError(f"{root}: {rel} is damaged (checksum mismatch)")
