"""kiln_cpu's native library: built for a target at compile time, loaded by the runtime.

The C source (csrc/cpu_kernels.c) is compiled with the system C compiler (`$CC`, else
`cc`) and `-march` of the target's x86-64 level, never `native`, so the library runs on
every machine of that level. Builds are kept in the kiln cache (`kernels/`) under an id
that hashes the source, the flags and the compiler's version; `kiln compile` copies the
build into the artefact. A library in that folder was built by this user's kiln, which is
what lets the runtime trust it (see runtime/native.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.target import CPU_EXTRA_CFLAGS, Target
from kiln.paths import cache_dir, pid_alive

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# -ffp-contract=fast: ISO C mode (-std=c11) otherwise keeps a * b + c as two roundings and
# two instructions; fused multiply-adds are what the dot products want.
# -fno-trapping-math: kiln never reads the floating-point exception flags, and without it
# GCC will not turn a loop's comparisons into selects unless AVX-512 masks do it for free: on
# AVX2 every loop through kexp (SiLU, GELU, the softmaxes) ran scalar, 6x slower. Results
# are unchanged (it permits no reassociation, keeps NaNs, infinities and signed zeros).
BASE_FLAGS = (
    "-ffp-contract=fast",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
)

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# kiln_abi_version() of a library whose exports match _SIGNATURES.
ABI_VERSION = 15
_SIGNATURES = {
    "kiln_abi_version": (_I64, []),
    "kiln_rmsnorm_f32": (None, [_P, _I64, _I64, _P, _P, _I64, _I64, _F32, _INT]),
    "kiln_add_rmsnorm_f32": (None, [_P, _P, _P, _P, _P, _I64, _I64, _F32, _INT]),
    "kiln_layernorm_f32": (None, [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _F32, _INT]),
    "kiln_silu_and_mul_f32": (None, [_P, _P, _I64, _I64, _INT]),
    "kiln_gelu_tanh_f32": (None, [_P, _I64, _P, _I64, _I64, _INT]),
    "kiln_softcap_f32": (None, [_P, _I64, _F32, _P, _I64, _I64, _INT]),
    "kiln_rope_f32": (None, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "kiln_kv_write_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64]),
    "kiln_kv_write_fp8": (
        None,
        [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _INT, _F32],
    ),
    "kiln_linear_lanes": (_I64, []),
    "kiln_linear_group_panels": (_I64, []),
    "kiln_linear_f32": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT, _INT, _INT]),
    "kiln_embedding_packed_f32": (_INT, [_P, _I64, _P, _I64, _I64, _P]),
    "kiln_qlinear_f32": (
        _INT,
        [_P, _I64, _I64, _I64, _P, _P, _INT, _I64, _I64, _P, _P, _INT, _INT],
    ),
    "kiln_a8_linear_f32": (_INT, [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _INT, _INT]),
    "kiln_a8_vnni": (_I64, []),
    "kiln_ga8_linear_f32": (
        _INT,
        [_P, _I64, _I64, _I64, _P, _P, _INT, _I64, _I64, _P, _P, _INT, _INT],
    ),
    "kiln_qembedding_f32": (_INT, [_P, _I64, _P, _P, _INT, _I64, _I64, _I64, _P]),
    "kiln_decode_attention": (
        _INT,
        [_P, _I64, _P, _P, _I64, _P, _I64, _P, _P, _P]
        + [_I64] * 5
        + [_I64, _F32, _INT, _F32, _F32, _P, _INT, _INT],
    ),
    "kiln_rope_decode_attention_f32": (
        _INT,
        [_P, _I64, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _P, _P]
        + [_I64] * 6
        + [_F32, _F32, _P, _INT, _INT],
    ),
}


# The kernel table a native step calls through (kernels/csrc/kiln_step.h `kiln_kernels`,
# field by field in this order).
STEP_KERNELS = (
    "kiln_rmsnorm_f32",
    "kiln_add_rmsnorm_f32",
    "kiln_silu_and_mul_f32",
    "kiln_rope_f32",
    "kiln_kv_write_f32",
    "kiln_linear_f32",
    "kiln_qlinear_f32",
    "kiln_a8_linear_f32",
    "kiln_ga8_linear_f32",
    "kiln_embedding_packed_f32",
    "kiln_qembedding_f32",
    "kiln_decode_attention",
    "kiln_rope_decode_attention_f32",
    "kiln_gelu_tanh_f32",
    "kiln_softcap_f32",
    "kiln_kv_write_fp8",
    "kiln_layernorm_f32",
)
# A KV pool's element type -> the kernels' kv_format (kernels/csrc/cpu_kernels.c): what the
# executor's attention passes per call and a native step names in kiln_step_kv_format.
KV_FORMATS = {"float32": 0, "float8_e4m3fn": 1, "float8_e5m2": 2}
# kiln_step_abi() of a step whose kiln_step_args (kiln_step.h) and exports match
# runtime/native_step.py and these signatures (compiler/lower_step.py writes it).
STEP_ABI = 9
# A step library's exports (compiler/lower_step.py writes them).
STEP_SIGNATURES = {
    "kiln_step_abi": (_I64, []),
    "kiln_step_arena_width": (_I64, []),
    "kiln_step_weights": (_I64, []),
    "kiln_step_weight_bytes": (_I64, [_I64]),
    "kiln_step_logits_width": (_I64, []),
    "kiln_step_hidden_width": (_I64, []),
    "kiln_step_hidden_rows": (_I64, []),
    "kiln_step_hidden_in_width": (_I64, []),
    "kiln_step_pool_floats": (_I64, []),
    "kiln_step_kv_format": (_I64, []),
    "kiln_step_rope_tables": (_I64, []),
    "kiln_step_rope_width": (_I64, [_I64]),
    "kiln_step_calls": (_I64, []),
    "kiln_step_call_node": (_I64, [_I64]),
    "kiln_step_lora_hooks": (_I64, []),
    "kiln_step_lora_weight": (_I64, [_I64]),
    "kiln_step_run": (_INT, [_P]),
}


class KernelBuildError(RuntimeError):
    pass


def compiler_command() -> str:
    return os.environ.get("CC", "cc")


@dataclass(frozen=True)
class Toolchain:
    """The C compiler a build uses: its command and what `--version` says."""

    cc: str
    version: str

    @classmethod
    def find(cls) -> Toolchain | None:
        cc = compiler_command()
        if shutil.which(cc) is None:
            return None
        try:
            out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        return cls(cc, out.stdout.splitlines()[0].strip() if out.stdout else cc)


def flags(target: Target) -> tuple[str, ...]:
    extra = CPU_EXTRA_CFLAGS.get(target.isa, ())
    # The baseline level (SSE2, the portable fallback) at -O2: gcc's -O3 spent 45 s on its
    # 256-bit generic vectors split into SSE halves (16 s at -O2) for 5% of decode speed
    # (Q4_1, 9.4 against 8.9 tok/s on a Zen 3, where the avx2 build decodes ~150).
    opt = "-O2" if target.isa == "x86-64" else "-O3"
    return (opt, *BASE_FLAGS, f"-march={target.march}", *extra, "-mtune=generic")


def library_flags(target: Target, toolchain: Toolchain) -> tuple[str, ...]:
    """The kernel library's flags: flags(target) and, with GCC, link-time optimisation run
    in parallel (`-flto=auto`). The library is one translation unit, which GCC optimises on
    one core; with LTO its back end runs in partitions on every core: 24 -> 14 s for the
    AVX2 build on a 2-core Zen 3, the same kernels (each partition's code is optimised as
    a whole; the output is the same bytes at any job count). Clang spells LTO otherwise and
    is left as it was, and so is a GCC that cannot link with LTO (_links_with_lto)."""
    lto = ("-flto=auto",) if _links_with_lto(toolchain) else ()
    return (*flags(target), *lto)


@functools.cache
def _links_with_lto(toolchain: Toolchain) -> bool:
    """Whether `toolchain` is a GCC that links a shared library with `-flto=auto`. An
    installation can lack the pieces LTO runs (seen on a GPU machine's image: its
    /opt/gcc/bin/gcc compiled but `ld` "could not run lto-wrapper", and every CPU compile
    failed): one tiny build answers (0.12 s on a 2-core Zen 3), once for a toolchain: the
    answer is kept in the kernel store, since a cache hit's key reads it too."""
    if "clang" in toolchain.version.lower():
        return False
    ident = f"{shutil.which(toolchain.cc) or toolchain.cc}\n{toolchain.version}"
    known = store() / f"lto-{hashlib.sha256(ident.encode()).hexdigest()[:20]}"
    try:
        return known.read_text() == "yes"
    except OSError:
        pass
    answer = _probe_lto(toolchain)
    with contextlib.suppress(OSError):  # a read-only store: probe again next time
        known.parent.mkdir(parents=True, exist_ok=True)
        part = known.with_name(f"{known.name}.{os.getpid()}.tmp")
        part.write_text("yes" if answer else "no")
        os.replace(part, known)
    return answer


def _probe_lto(toolchain: Toolchain) -> bool:
    with tempfile.TemporaryDirectory(prefix="kiln-lto-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int kiln_probe(int x) { return x + 1; }\n")
        command = [toolchain.cc, *BASE_FLAGS, "-flto=auto", "-o", f"{tmp}/probe.so", str(src)]
        try:
            done = subprocess.run(command, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0


def source_sha256() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build_id(target: Target, toolchain: Toolchain) -> str:
    h = hashlib.sha256()
    for part in (source_sha256(), " ".join(library_flags(target, toolchain)), toolchain.version):
        h.update(part.encode())
    return h.hexdigest()[:20]


def store() -> Path:
    """Where this user's builds are kept (and trusted)."""
    return cache_dir() / "kernels"


def build(target: Target, toolchain: Toolchain, out_dir: Path | None = None) -> Path:
    """Compile the kernels for `target` (or find them built) and return the library."""
    if target.device != "cpu":
        raise KernelBuildError(f"kiln_cpu kernels are for cpu targets, not {target}")
    out_dir = out_dir or store()
    lib = out_dir / f"cpu_kernels-{build_id(target, toolchain)}.so"
    return _compile(SOURCE, lib, library_flags(target, toolchain), toolchain)


def step_build_id(source: str, target: Target, toolchain: Toolchain) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(flags(target)), toolchain.version):
        h.update(part.encode())
    return h.hexdigest()[:20]


def build_step(source: str, target: Target, toolchain: Toolchain) -> Path:
    """Compile a native step (compiler/lower_step.py's C) for `target` into the store, or
    find it built there: `step-<id>.so`, its source beside it."""
    lib = store() / f"step-{step_build_id(source, target, toolchain)}.so"
    return _compile(lib.with_suffix(".c"), lib, flags(target), toolchain, text=source)


# A builder's temporaries: its work folder `<name>.<pid>.tmp` (older kilns also left files
# `<name>.<pid>.tmp` and `<name>.<pid>.tmp.c`), so a build killed mid-way (kill -9 of
# `kiln compile`) is recognised by its pid.
_TEMPORARY = re.compile(r".+\.(?P<pid>\d+)\.tmp(?:\.c)?")


def sweep(folder: Path) -> None:
    """Remove the temporaries of builders that no longer run."""
    for entry in folder.iterdir():
        hit = _TEMPORARY.fullmatch(entry.name)
        if hit and int(hit["pid"]) != os.getpid() and not pid_alive(int(hit["pid"])):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _compile(
    source: Path, lib: Path, cflags: tuple[str, ...], toolchain: Toolchain, text: str | None = None
) -> Path:
    """Build `source` (or `text`, kept as `source` beside the library) into `lib`, unless
    it is there.

    The compiler works in a folder of this builder's own, on files named as they will be
    published: the bytes it writes depend on the names it is given (a step's source file
    name lands in the library), so any builder, any process, writes the same library.
    Publishing is a hard link that never replaces: when builders race (two `kiln compile`s
    sharing a cache), the first library stays, and so does the checksum that the artefacts
    already made with it carry (runtime/native.py trusts a step only if the store holds its
    checksum)."""
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with _building(lib):  # a second builder of `lib` waits here, then finds it built
        if lib.exists():
            return lib
        sweep(lib.parent)
        _build(source, lib, cflags, toolchain, text)
    return lib


@contextlib.contextmanager
def _building(lib: Path) -> Iterator[None]:
    """Hold the build lock of `lib` (`.<name>.lock` beside it): one process builds it
    (14-24 s for the kernel library on a 2-core CI machine), the others wait for it."""
    fd = os.open(lib.with_name(f".{lib.name}.lock"), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _build(
    source: Path, lib: Path, cflags: tuple[str, ...], toolchain: Toolchain, text: str | None
) -> None:
    work = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        src = source
        if text is not None:
            src = work / source.name
            src.write_text(text)
        built = work / lib.name
        # libraries after the source
        command = [toolchain.cc, *cflags, "-o", str(built), str(src), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            msg = f"{toolchain.cc} failed on {source.name}: {' / '.join(tail)}"
            raise KernelBuildError(msg)
        if text is not None:
            _publish(src, source)
        _publish(built, lib)  # last: a reader that finds the library finds its source
    finally:
        shutil.rmtree(work, ignore_errors=True)  # an error or an interrupt leaves nothing


def _publish(built: Path, final: Path) -> None:
    """Put `built` at `final` whole and at once, unless another builder got there first."""
    try:
        os.link(built, final)
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: replace, atomically, if still absent
        if not final.exists():
            os.replace(built, final)


def load_step(path: Path) -> ctypes.CDLL:
    """A native step library with its exports' signatures declared; KernelBuildError if it
    was written for other signatures, AttributeError if it lacks an export."""
    return _bind(path, STEP_SIGNATURES, "kiln_step_abi", STEP_ABI, "a step")


def load(path: Path) -> ctypes.CDLL:
    """The library with its functions' signatures declared; KernelBuildError if it was
    built from a kiln source of other signatures, AttributeError if it lacks one."""
    return _bind(path, _SIGNATURES, "kiln_abi_version", ABI_VERSION, "kernels")


def _bind(
    path: Path, signatures: dict[str, Any], version: str, want: int, what: str
) -> ctypes.CDLL:
    """The ABI version first: a library of another kiln says so, not which export of
    this one's it lacks."""
    lib = ctypes.CDLL(str(path))
    getattr(lib, version).restype = ctypes.c_int64
    if (got := getattr(lib, version)()) != want:
        raise KernelBuildError(
            f"{path.name}: {what} of ABI {got}, this kiln calls ABI {want}; recompile the "
            "artefact with this kiln"
        )
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
