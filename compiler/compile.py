"""The compile driver: checkpoint -> trace -> passes -> artefact. `kiln compile` reaches it
through the cache (compiler/store.py), only on a miss."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

from kiln.args import ArgError, ServerArgs
from kiln.compiler.checkpoint import CheckpointError, CheckpointReader
from kiln.compiler.hub import hub_name
from kiln.compiler.key import CompileKey, draft_args, model_overrides, resolve_dtype
from kiln.compiler.lower_step import LoweredStep, Refused, lower_step
from kiln.compiler.options import (
    EAGLE_ALGORITHMS,
    KV_DTYPES,
    compile_options,
    speculative_algorithm,
)
from kiln.compiler.publish import publish, staging_dir
from kiln.compiler.store import CompileResult, compile_cached
from kiln.core import artefact as fmt
from kiln.core.ir import Graph, WeightSpec
from kiln.core.layout import pack_panels, pack_qpanels, panel_shape
from kiln.core.ops import ATTENTION_OPS, STRUCTURAL_OPS
from kiln.core.quant import FORMATS, quantize, with_int8_activations
from kiln.core.recipes import head_part_rows, rotary_rows
from kiln.core.target import Target
from kiln.core.trace import trace
from kiln.kernels import native
from kiln.models import ModelConfig, ModelConfigError, build
from kiln.models.config import MTP_ARCHITECTURES, EagleHead, read_hf_config
from kiln.models.eagle import build_eagle
from kiln.models.rope import inv_freq
from kiln.passes import PIPELINE, run_passes
from kiln.version import __version__

log = logging.getLogger("kiln.compile")

__all__ = ["build_artefact", "compile_model", "resolve_dtype"]


def compile_model(args: ServerArgs, out: str | Path | None = None) -> CompileResult:
    """Compile through the cache (a hit returns at once); with `out`, place the artefact
    there too."""
    return compile_cached(args, build_artefact, out)


def build_artefact(args: ServerArgs, ck: CompileKey, out: Path) -> None:
    """Trace, run the passes and write the artefact of `ck` at `out` (staged, then
    published); the cache (compiler/store.py) decides when this runs."""
    target, dtype, toolchain = ck.target, ck.dtype, ck.toolchain
    if target.device == "cpu" and toolchain is None:
        log.warning(
            "no C compiler (%s): kiln's CPU kernels are not built, the artefact runs the "
            "slower reference kernels; install gcc and recompile for the fast path",
            native.compiler_command(),
        )
    with CheckpointReader(ck.checkpoint, ck.load_format) as reader:
        hf = reader.gguf.hf_config() if reader.gguf is not None else read_hf_config(ck.checkpoint)
        cfg = ModelConfig.from_dict({**hf, **model_overrides(args)})
        if cfg.num_labels and "score.bias" in reader.names():
            raise ArgError(f"{ck.checkpoint}: its score head has a bias, which kiln's "
                           "classifier head (transformers') does not add")  # fmt: skip
        if cfg.num_labels and not args.is_embedding:  # a classifier pools, as in SGLang
            log.info("%s is a sequence classifier: compiled as --is-embedding", cfg.architecture)
            args = args.replace(is_embedding=True)
        options = compile_options(args, ck, reader, cfg)
        eagle = _eagle_head(args, cfg, reader, ck, hf)
        ranks = []  # (graph, pass log, constants) of each rank
        for rank in range(options.tp.size):
            graph, constants = trace(
                build(
                    cfg,
                    args.is_embedding,
                    hidden_states=args.enable_return_hidden_states,
                    eagle=None if eagle is None else eagle.tap,
                )
            )
            graph.context_length = cfg.max_position_embeddings
            for spec in graph.weights.values():
                if "constant" not in spec.source:  # a checkpoint tensor, however cut
                    spec.dtype = dtype
            ranks.append((*run_passes(graph, options.for_rank(rank), PIPELINE), constants))
        graph, pass_log, _ = ranks[0]
        uses_native = _uses_native(graph)
        step = _lower_step(graph, options, uses_native)
        if options.deterministic and target.device == "cpu":
            _all_steps_native(graph)

        tmp = staging_dir(out)
        try:
            try:
                built, step_info = _native_files(uses_native, step, ck, tmp)
                for rank, (g, _, constants) in enumerate(ranks):
                    _write_weights(tmp / fmt.weights_file(rank), g, reader, constants)
                    (tmp / fmt.graph_file(rank)).write_text(g.dumps())
                if ck.tokenizer_dir is not None:
                    _copy_tokenizer(ck.tokenizer_dir, tmp / fmt.TOKENIZER_DIR)
                else:
                    assert reader.gguf is not None  # only GGUF carries its own tokenizer
                    reader.gguf.write_tokenizer(tmp / fmt.TOKENIZER_DIR)
                speculative = options.speculative
                if speculative is not None and speculative["algorithm"] == "STANDALONE":
                    speculative = {**speculative, "draft": _draft_model(args, cfg, tmp)}
                if eagle is not None:
                    assert speculative is not None
                    speculative = {**speculative, "draft": eagle.write(args, ck, tmp, graph)}
                manifest = _manifest(args, cfg, graph, tmp, ck, pass_log)
                if eagle is not None:
                    manifest["runtime"]["eagle_hidden"] = eagle.tap.hidden_size
                if speculative is not None:
                    manifest["runtime"]["speculative"] = speculative
                manifest["native"] = built
                manifest["native_step"] = step_info
                (tmp / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))
            except (OSError, SafetensorError) as e:
                raise fmt.ArtefactError(f"{out}: cannot write the artefact: {e}") from None
            publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if eagle is not None:
                eagle.reader.close()


class _Eagle:
    """An EAGLE head (--speculative-algorithm EAGLE or EAGLE3) being compiled with its
    model: its checkpoint open, what the model's graph returns for it (`tap`), and the
    head's own artefact, written into the model's draft/ (`write`)."""

    def __init__(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        model: CheckpointReader,
        ck: CompileKey,
        model_hf: dict[str, Any],
    ) -> None:
        given = args.speculative_draft_model_path
        flag = "--speculative-draft-model-path"
        # A model's own MTP layer (SGLang's NEXTN; its EAGLE without a head for these)
        own = not given or Path(given).resolve() == ck.checkpoint.resolve()
        if own and cfg.architecture in MTP_ARCHITECTURES:
            self._own_mtp(args, cfg, model, ck, model_hf)
            return
        if not given:
            raise ArgError(
                f"--speculative-algorithm {args.speculative_algorithm}: needs {flag} (the "
                f"EAGLE head's checkpoint; {', '.join(MTP_ARCHITECTURES)} draft with their "
                "own MTP layer without one)"
            )
        path = Path(given)
        try:
            hf = read_hf_config(path)
            self.reader = CheckpointReader(path)
        except (ModelConfigError, CheckpointError) as e:
            raise ArgError(f"{flag}: {e}") from None
        self.reader.strip_prefix("model.")
        try:
            self.head = EagleHead.read(hf, set(self.reader.names()), cfg.num_layers)
            # served at the model's context, whatever the head's config says
            self.cfg = ModelConfig.from_dict(
                {**hf, "max_position_embeddings": cfg.max_position_embeddings}
            )
        except ModelConfigError as e:
            self.reader.close()
            raise ArgError(f"{flag}: {e}") from None
        problem = self._problem(args, cfg, hf)
        if problem is not None:
            self.reader.close()
            raise ArgError(f"{flag}: {problem}")
        self._share(cfg, model)

    def _own_mtp(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        model: CheckpointReader,
        ck: CompileKey,
        hf: dict[str, Any],
    ) -> None:
        """The model's MTP layer, read from its own checkpoint."""
        flag = f"--speculative-algorithm {args.speculative_algorithm}"
        try:
            self.head = EagleHead.mtp_of(cfg, hf)
        except ModelConfigError as e:
            raise ArgError(f"{flag}: {e}") from None
        self.cfg = self.head.mtp_config(cfg, hf)
        self.reader = CheckpointReader(ck.checkpoint, model.load_format)
        layer = f"model.layers.{self.head.mtp}."
        self.reader.rename_prefix(layer, "mtp.")
        if not self.reader.has("mtp.eh_proj.weight"):
            self.reader.close()
            raise ArgError(
                f"{flag}: {ck.checkpoint} has no MTP layer weights ({layer}eh_proj.weight), "
                "though its config says it has one"
            )
        self._share(cfg, model)

    def _share(self, cfg: ModelConfig, model: CheckpointReader) -> None:
        """What the head reads of the model's weights, and the model of the head's."""
        self.tap = self.head.tap(self.cfg.hidden_size)
        # The model's embedding always (SGLang's too), its lm_head where the head has none.
        self.reader.borrow("embed_tokens.weight", model, "model.embed_tokens.weight")
        if not self.head.own_lm_head:
            tied = cfg.tie_word_embeddings
            lm_head = "model.embed_tokens.weight" if tied else "lm_head.weight"
            self.reader.borrow("lm_head.weight", model, lm_head)
        for part in ("weight", "bias"):  # EAGLE-3's fc runs in the model's graph
            model.borrow(f"eagle3_fc.{part}", self.reader, f"fc.{part}")

    def _problem(self, args: ServerArgs, cfg: ModelConfig, hf: dict[str, Any]) -> str | None:
        """Why the head cannot draft for this model, or None."""
        head, mine = self.head, self.cfg
        if head.algorithm != speculative_algorithm(args):
            return f"it is an {head.algorithm} head, for --speculative-algorithm {head.algorithm}"
        if mine.vocab_size != cfg.vocab_size:
            return f"its vocabulary has {mine.vocab_size} tokens and the model's {cfg.vocab_size}"
        if head.algorithm == "EAGLE" and mine.hidden_size != cfg.hidden_size:
            return (
                f"it reads hidden states of {mine.hidden_size}, the model's are {cfg.hidden_size}"
            )
        if hf.get("target_hidden_size", cfg.hidden_size) != cfg.hidden_size:
            return (
                f"its fc reads hidden states of {hf['target_hidden_size']}, the model's are "
                f"{cfg.hidden_size}"
            )
        if head.draft_vocab_size != cfg.vocab_size and not self.reader.has("d2t"):
            return "it has no d2t (its draft vocabulary's ids in the model's)"
        return None

    def write(self, args: ServerArgs, ck: CompileKey, tmp: Path, model: Graph) -> dict[str, Any]:
        """The head's artefact in `tmp`'s draft/ (after the model's tokenizer, which it
        shares); the manifest's record of it. `model`: the model's graph, whose embedding
        and lm_head (where the head has none of its own) the head's steps compute with the
        model's weights, on a CPU target (one copy in memory; runtime/artefact.py)."""
        out = tmp / fmt.DRAFT_DIR
        # its steps return (logits, its own hidden states), on the model's capture plan
        head_path = args.speculative_draft_model_path or str(ck.checkpoint)  # or the MTP's
        dargs = draft_args(
            args.replace(speculative_draft_model_path=head_path), int8_activations=False
        ).replace(enable_return_hidden_states=True, disable_cuda_graph=args.disable_cuda_graph)
        options = compile_options(dargs, ck, self.reader, self.cfg)
        graph, constants = trace(build_eagle(self.cfg, self.head))
        graph.context_length = self.cfg.max_position_embeddings
        for spec in graph.weights.values():
            if "constant" not in spec.source:
                spec.dtype = ck.dtype
        graph, pass_log = run_passes(graph, options.for_rank(0), PIPELINE)
        if ck.target.device == "cpu":
            roles = ("embedding",) if self.head.own_lm_head else ("embedding", "lm_head")
            _graft(graph, model, roles)
        native_kernels = _uses_native(graph)
        step = _lower_step(graph, options, native_kernels)
        built, step_info = _native_files(native_kernels, step, ck, out)
        _write_weights(out / fmt.weights_file(0), graph, self.reader, constants)
        (out / fmt.graph_file(0)).write_text(graph.dumps())
        shutil.copytree(tmp / fmt.TOKENIZER_DIR, out / fmt.TOKENIZER_DIR)
        manifest = _manifest(dargs, self.cfg, graph, out, ck, pass_log)
        if self.head.draft_vocab_size != self.cfg.vocab_size:
            manifest["runtime"]["logits_size"] = self.head.draft_vocab_size
        manifest["native"], manifest["native_step"] = built, step_info
        (out / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))
        ref: dict[str, Any] = {
            # the head's checkpoint's key (a model's own MTP layer: the model's)
            "cache_key": ck.factors.get("speculative_draft", ck.key),
            "vocab_size": self.cfg.vocab_size,
        }
        if self.head.draft_vocab_size != self.cfg.vocab_size:
            d2t = self.reader.get("d2t", (self.head.draft_vocab_size,))
            ref["hot_ids"] = (d2t.long() + torch.arange(len(d2t))).tolist()
        return ref


def _graft(head: Graph, model: Graph, roles: tuple[str, ...]) -> None:
    """The head's node of each role (its embedding, its lm_head) made the model's: the
    same op, attributes and kernel over the model's weights (source {"model": name}, not
    written into the head's artefact), where both graphs have one such node."""
    for role in roles:
        mine = [n for n in head.nodes if n.meta.get("role") == role]
        theirs = [n for n in model.nodes if n.meta.get("role") == role]
        if len(mine) != 1 or len(theirs) != 1 or any(a.op != "param" for a in theirs[0].args[1:]):
            continue
        node, like = mine[0], theirs[0]
        params = []
        for a in like.args[1:]:
            name = a.attrs["name"]
            spec = model.weights[name]
            head.weights[name] = WeightSpec(spec.shape, spec.dtype, {"model": name}, spec.layout)
            found = [n for n in head.nodes if n.op == "param" and n.attrs["name"] == name]
            params.append(
                found[0] if found else head.add("param", attrs={"name": name}, before=head.nodes[0])
            )
        node.op, node.attrs, node.meta = like.op, dict(like.attrs), dict(like.meta)
        node.args = [node.args[0], *params]
    used = {id(a) for n in head.nodes for a in n.args}
    for n in [n for n in head.nodes if n.op == "param" and id(n) not in used]:
        head.nodes.remove(n)
        del head.weights[n.attrs["name"]]


def _eagle_head(
    args: ServerArgs,
    cfg: ModelConfig,
    reader: CheckpointReader,
    ck: CompileKey,
    hf: dict[str, Any],
) -> _Eagle | None:
    if args.speculative_algorithm not in EAGLE_ALGORITHMS:
        return None
    return _Eagle(args, cfg, reader, ck, hf)


def _draft_model(args: ServerArgs, cfg: ModelConfig, tmp: Path) -> dict[str, Any]:
    """STANDALONE: the draft model compiled through the cache (compiler/key.py
    `draft_args`) into the artefact's draft/, after the model's own tokenizer is written;
    its vocabulary and tokenizer must be the model's. Returns the manifest's record of it."""
    out = tmp / fmt.DRAFT_DIR
    try:
        try:
            result = compile_model(draft_args(args), out)
        except ArgError as e:
            if "--quantize-activations" not in str(e) or args.quantize_activations != "none":
                raise
            result = compile_model(draft_args(args, int8_activations=False), out)
    except ArgError as e:
        raise ArgError(f"--speculative-draft-model-path: {e}") from None
    log.info("draft model %s: %s", args.speculative_draft_model_path, result.cache_key[:16])
    runtime = json.loads((out / fmt.MANIFEST).read_text())["runtime"]
    vocab = runtime["vocab_size"]
    if vocab != cfg.vocab_size:
        raise ArgError(
            f"--speculative-draft-model-path: its vocabulary has {vocab} tokens and the "
            f"model's {cfg.vocab_size}: a draft model must share the model's tokenizer"
        )
    for name in fmt.TOKENIZER_FILES:
        mine, its = tmp / fmt.TOKENIZER_DIR / name, out / fmt.TOKENIZER_DIR / name
        if mine.is_file() != its.is_file() or (
            mine.is_file() and mine.read_bytes() != its.read_bytes()
        ):
            raise ArgError(
                f"--speculative-draft-model-path: its tokenizer ({name}) differs from the "
                "model's: a draft model must share the model's tokenizer"
            )
    return {"cache_key": result.cache_key, "vocab_size": vocab}


def _all_steps_native(graph: Graph) -> None:
    """--enable-deterministic-inference holds where every step is the lowered C step (its
    attention the batch-invariant kernel): refuse an artefact whose prompts or decode
    steps would run the executor's other attention."""
    plan = graph.plan or {}
    eager = [k for k in ("prefill", "decode") if plan.get(k, {}).get("mode") != "native"]
    if eager:
        why = plan.get("decode", {}).get("native_refused") or (
            "an fp8 KV pool's prompts run in the executor"
        )
        raise ArgError(
            f"--enable-deterministic-inference: needs every step lowered to C, and the "
            f"{' and '.join(eager)} steps are not ({why})"
        )


def _uses_native(graph: Graph) -> bool:
    """Whether any node of `graph` runs a kiln_cpu kernel."""
    return any(
        n.meta.get("backend") == "kiln_cpu" for n in graph.nodes if n.op not in STRUCTURAL_OPS
    )


def _native_files(
    uses_native: bool, step: LoweredStep | None, ck: CompileKey, root: Path
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The kernel library and the lowered step built into `root`, where the graph has
    them; the manifest's `native` and `native_step` entries."""
    built = step_info = None
    if uses_native:
        assert ck.toolchain is not None
        built = _native_build(ck.target, ck.toolchain, root)
    if step is not None:
        assert ck.toolchain is not None
        step_info = _step_build(step, ck.target, ck.toolchain, root)
    return built, step_info


def _lower_step(graph: Graph, options: Any, uses_native: bool) -> LoweredStep | None:
    """The step as C when the plan asks for it and the graph lowers; otherwise the plan's
    native modes become "eager" with the reason recorded (`kiln inspect` shows it)."""
    plan = graph.plan
    if plan is None or plan["decode"]["mode"] != "native":
        return None
    why = None
    if not uses_native:
        why = "the kiln_cpu kernels were not built for it"
    else:
        try:
            kv = options.kv_cache
            step = lower_step(graph, None if kv is None else kv.dtype)
            if kv is not None and plan["prefill"]["mode"] == "native":
                # The executor's prompt attention reads the step's own K/V as computed,
                # the step's would read them back rounded from the pool: prompts stay the
                # executor's, decode steps are native.
                plan["prefill"]["mode"] = "eager"
            return step
        except Refused as e:
            why = str(e)
    plan["decode"]["mode"] = "eager"
    plan["decode"]["native_refused"] = why
    if plan["prefill"]["mode"] == "native":
        plan["prefill"]["mode"] = "eager"
    if uses_native:  # else the missing compiler's warning has said it
        log.info("steps run in the Python executor: %s", why)
    return None


def _step_build(
    step: LoweredStep, target: Target, toolchain: native.Toolchain, root: Path
) -> dict[str, Any]:
    """Build (or take from the kernel store) the lowered step and copy it and its C into
    the artefact."""
    try:
        lib = native.build_step(step.source, target, toolchain)
    except native.KernelBuildError as e:
        raise ArgError(f"--target-isa {target.isa}: the native step: {e}") from None
    dst = root / fmt.STEP_LIB
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lib, dst)
    (root / fmt.STEP_SOURCE).write_text(step.source)
    return {
        "file": fmt.STEP_LIB,
        "source": fmt.STEP_SOURCE,
        "build_id": native.step_build_id(step.source, target, toolchain),
        "sha256": fmt.sha256_file(dst),
        "weights": step.weights,
        "arena_width": step.arena_width,
        "calls": step.calls,
    }


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
        "flags": list(native.library_flags(target, toolchain)),
        "compiler": toolchain.version,
        "lanes": lanes,
        "group_panels": group,
    }


def _model_name(model_path: str | None) -> str:
    """The served name a checkpoint gives: its Hub id when fetched from the Hub (as SGLang
    serves `--model-path` itself), else its folder's or file's name."""
    path = Path(model_path or "model")
    return hub_name(path) or (path.stem if path.suffix == ".gguf" else path.name)


def _recorded_args(args: ServerArgs) -> dict[str, Any]:
    # Paths are inputs, not properties of the artefact: only the folder name (a Hub
    # snapshot's repository id) is kept.
    values = args.stage_values("compile")
    for name in ("model_path", "tokenizer_path"):
        if values.get(name):
            values[name] = hub_name(values[name]) or Path(values[name]).name
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
    if "join" in src:  # weights flattened end to end (per-head norm weights)
        return torch.cat([_materialise(s, reader, constants).reshape(-1) for s in src["join"]])
    if "shift" in src:  # a checkpoint weight plus a constant (Gemma's 1 + w norms)
        return _materialise(src["shift"], reader, constants) + src["by"]
    if "slice" in src:  # a rank's part (passes/shard.py), a fused weight's (Phi-3)
        whole = _materialise(src["slice"], reader, constants)
        return whole.narrow(src["dim"], src["start"], src["stop"] - src["start"])
    if "zeros" in src:  # a bias only rank 0 adds (passes/shard.py)
        return torch.zeros(src["zeros"])
    if "expert" in src:  # one expert's part of a stacked expert tensor (GPT-OSS)
        key = json.dumps(src["expert"], sort_keys=True)
        if key not in _STACKED:  # read (and dequantized) once for all its experts
            _STACKED.clear()
            _STACKED[key] = _materialise(src["expert"], reader, constants)
        return _expert_part(_STACKED[key], src)
    if "head_parts" in src:  # DeepSeek's q and latent projections (models/decoder.py)
        return _materialise(src["head_parts"], reader, constants)[head_part_rows(src)]
    if "mla_absorb" in src:  # kv_b_proj's key or value half, per head (passes/absorb_mla.py)
        return _absorbed(_materialise(src["mla_absorb"], reader, constants), src)
    if "rotary_order" in src:  # a partial rotary's q or k rows (kiln.core.recipes)
        return _materialise(src["rotary_order"], reader, constants)[rotary_rows(src)]
    raise ValueError(f"unknown weight recipe {src}")


def _absorbed(kv_b: torch.Tensor, src: dict[str, Any]) -> torch.Tensor:
    """kv_b_proj [heads * (nope + v), latent] -> the key half as [heads, latent, nope]
    (q_latent = q_nope W_uk) or the value half as [heads, v, latent]."""
    heads, nope = src["heads"], src["nope"]
    w = kv_b.view(heads, -1, kv_b.shape[-1])
    if src["part"] == "k":
        return w[:, :nope].transpose(1, 2).contiguous()
    return w[:, nope:].contiguous()


_STACKED: dict[str, torch.Tensor] = {}  # the stacked expert tensor last read


def _expert_part(whole: torch.Tensor, src: dict[str, Any]) -> torch.Tensor:
    """Expert `index` of a [experts, ...] tensor; of its last dimension every `step`-th
    element from `start` (GPT-OSS interleaves gate and up); transposed if asked (GPT-OSS
    stores [in, out])."""
    t = whole[src["index"]]
    start, step = src.get("take") or (0, 1)
    if (start, step) != (0, 1):
        t = t[..., start::step]
    return t.transpose(0, 1) if src.get("transpose") else t


def _quantized(
    src: dict[str, Any], reader: CheckpointReader, constants: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a {"quantize": recipe} weight; row concatenations part by part
    (scales are per row), checkpoint tensors through the reader (GGUF blocks as stored), a
    rank's slice as that part of the whole weight's codes and scales (passes/quantize.py).
    An int8-activation format is its weight format's codes and scales, whatever the recipe,
    with a code-sum plane made for exactly those codes."""
    inner, fmt, group = src["quantize"], src["format"], src["group"]
    base = FORMATS[fmt].base
    if base is not None and FORMATS[fmt].kernel == "ga8":
        weights = _quantized({**src, "format": base}, reader, constants)
        return with_int8_activations(*weights, fmt)
    if "concat" in inner:
        parts = [_quantized({**src, "quantize": s}, reader, constants) for s in inner["concat"]]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    if "slice" in inner:
        # w8a8_int8's correction plane sums a row's codes: made for the rank's part.
        base = base or fmt
        whole = {**src, "quantize": inner["slice"], "format": base}
        codes, scales = _quantized(whole, reader, constants)
        dim, lo, hi = inner["dim"], inner["start"], inner["stop"]
        codes = codes.narrow(dim, lo, hi - lo)
        if dim == 0:
            scales = scales.narrow(0, lo, hi - lo)
        elif group:  # whole groups (the pass checked); a per-row scale stays the row's
            span = group * (FORMATS[base].superblock or 1)  # a record a super-block
            scales = scales.narrow(1, lo // span, (hi - lo) // span)
        return (codes, scales) if base == fmt else with_int8_activations(codes, scales, fmt)
    if "rotary_order" in inner:  # whole rows move: their codes and scales with them
        codes, scales = _quantized({**src, "quantize": inner["rotary_order"]}, reader, constants)
        rows = rotary_rows(inner)
        return codes[rows], scales[rows]
    if "load" in inner:
        return reader.quantized(inner["load"], fmt, group)
    return quantize(_materialise(inner, reader, constants), fmt, group)


def _write_weights(
    path: Path, graph: Graph, reader: CheckpointReader, constants: dict[str, torch.Tensor]
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # codes and scales, by recipe
    bar = tqdm(graph.weights.items(), desc="weights", unit="tensor", disable=None, leave=False)
    for name, spec in bar:
        if "model" in spec.source:  # the model's weight, served from the model's artefact
            continue
        if "quantize" in spec.source:
            key = json.dumps({k: v for k, v in spec.source.items() if k != "part"}, sort_keys=True)
            if key not in done:
                done[key] = _quantized(spec.source, reader, constants)
            t = done[key][0 if spec.source["part"] == "codes" else 1]
            if spec.source["part"] == "scales":  # float16 where the format keeps halves
                t = t.to(getattr(torch, spec.dtype))
            if tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"weight {name}: quantized {tuple(t.shape)}, graph wants {spec.shape}"
                )
            tensors[name] = pack_qpanels(t.contiguous(), spec.layout)
            continue
        t = _materialise(spec.source, reader, constants)
        dtype = getattr(torch, spec.dtype)
        t = t.to(dtype).contiguous()
        if tuple(t.shape) != spec.shape:
            raise ValueError(
                f"weight {name}: built shape {tuple(t.shape)}, graph wants {spec.shape}"
            )
        tensors[name] = t if spec.layout == "rows" else pack_panels(t, spec.layout)
    _STACKED.clear()
    path.parent.mkdir(parents=True, exist_ok=True)
    # One metadata entry: safetensors writes a header's entries in hash order, which changes
    # from process to process, and the same inputs must give the same bytes.
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    copied = [n for n in fmt.TOKENIZER_FILES if (src / n).is_file()]
    for n in copied:
        shutil.copy2(src / n, dst / n)
    if not copied:
        log.warning("no tokenizer files in %s: the artefact will take token ids only", src)


def _sampling_defaults(tok_dir: Path) -> dict[str, int | float]:
    """The sampling parameters generation_config.json recommends (SGLang's
    --sampling-defaults model reads these five), the numbers the file states; HF's top_k 0
    (no top-k) is kiln's -1. The server checks their ranges before it uses them: a
    checkpoint's odd file must not stop its compile."""
    gen = tok_dir / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        stated = json.loads(gen.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("generation_config.json is not valid JSON: no recommended sampling")
        return {}
    if not isinstance(stated, dict):
        return {}
    out: dict[str, int | float] = {}
    for key in fmt.SAMPLING_DEFAULT_KEYS:
        value = stated.get(key)
        if key == "top_k" and value == 0:
            value = -1
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = value
    return out


def _eos_ids(cfg: ModelConfig, tok_dir: Path) -> list[int]:
    ids = list(cfg.eos_token_ids)
    gen = tok_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and e not in ids:
                ids.append(int(e))
    return ids


def _long_rope(cfg: ModelConfig, graph: Graph) -> list[dict[str, Any]]:
    """LongRoPE's long-context table for each rope table written with the short one."""
    out = []
    tables = (("rope.inv_freq", cfg.rope), ("rope.local_inv_freq", cfg.local_rope))
    for name, rope in tables:
        if rope is None or rope.rope_type != "longrope" or name not in graph.weights:
            continue
        assert rope.original_max_position_embeddings is not None
        freq = inv_freq(rope, cfg.rotary, cfg.head_dim, long=True)
        out.append(
            {
                "weight": name,
                "context_above": rope.original_max_position_embeddings,
                "inv_freq": freq.tolist(),
            }
        )
    return out


def _manifest(
    args: ServerArgs,
    cfg: ModelConfig,
    graph: Graph,
    root: Path,
    ck: CompileKey,
    pass_log: list[dict[str, Any]],
) -> dict[str, Any]:
    dtype, target = ck.dtype, ck.target
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return {
        "format_version": fmt.FORMAT_VERSION,
        "kiln_version": __version__,
        "torch_version": torch.__version__,
        "target": target.to_json(),
        "model": cfg.to_dict(),
        # What the runtime needs to know about the model, without reading `model`.
        "runtime": {
            "num_layers": cfg.num_layers,
            # Per rank: a tensor-parallel rank's pool holds only its KV heads.
            "num_kv_heads": next(
                n.attrs["num_kv_heads"] for n in graph.nodes if n.op in ATTENTION_OPS
            ),
            "tp_size": args.tp_size,
            # The pooled width: a latent attention pools latent + rope features in K alone.
            "head_dim": next(n.attrs["head_dim"] for n in graph.nodes if n.op in ATTENTION_OPS),
            "v_head_dim": 0 if cfg.kv_lora_rank else None,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.max_position_embeddings,
            "dtype": dtype,
            "page_size": args.page_size,
            "kv_dtype": KV_DTYPES.get(args.kv_cache_dtype, dtype),
            "bos_token_id": cfg.bos_token_id,
            "eos_token_ids": _eos_ids(cfg, root / fmt.TOKENIZER_DIR),
            "sampling_defaults": _sampling_defaults(root / fmt.TOKENIZER_DIR),
            "served_model_name": _model_name(args.model_path),
            "long_rope": _long_rope(cfg, graph),
            # --is-embedding: steps give final hidden states, pooled and normalised; a
            # classifier's, its labels' logits (pooled, as they are)
            "is_embedding": args.is_embedding,
            "labels": list(cfg.labels),
            # what a request's `dimensions` may ask of such a model (Matryoshka widths)
            "embedding_dim": (cfg.num_labels or cfg.hidden_size) if args.is_embedding else None,
            "matryoshka": args.is_embedding and cfg.is_matryoshka,
            "matryoshka_dimensions": list(cfg.matryoshka_dimensions) if args.is_embedding else [],
            # --enable-return-hidden-states: steps return (logits, final hidden states)
            "return_hidden_states": args.enable_return_hidden_states,
        },
        # As given (serving compares what it is given with these); the key's are resolved.
        "compile_args": _recorded_args(args),
        "cache_key": ck.key,
        "cache_factors": ck.factors,
        "passes": pass_log,
        "files": {rel: fmt.file_entry(root, rel) for rel in files},
    }
