"""ModelConfig: the one typed view of a Hugging Face `config.json` that kiln reads."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_type -> the family flags our single decoder definition needs.
_FAMILIES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "mixtral": {"qkv_bias": False, "qk_norm": False},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True},
    # Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases), Qwen3-MoE's routing, and a
    # shared expert every token runs, its output times sigmoid(shared_expert_gate(x)).
    "qwen2_moe": {"qkv_bias": True, "qk_norm": False},
    # Gemma 3's text model: GELU-tanh MLP, norms that scale by 1 + w around attention and
    # MLP both, embeddings times sqrt(hidden), its own rope for the sliding layers.
    "gemma3_text": {"qkv_bias": False, "qk_norm": True},
    # Gemma 2: as Gemma 3 without q/k norms or a local rope, with soft-capped attention
    # scores and final logits.
    "gemma2": {"qkv_bias": False, "qk_norm": False},
    # Phi-3, 3.5 and Phi-4-mini: Llama's layer with q/k/v and gate/up each one tensor in
    # the checkpoint, LongRoPE, and (Phi-4-mini) rope over part of each head.
    "phi3": {"qkv_bias": False, "qk_norm": False},
    # GPT-OSS: biases on every attention projection, a learned sink logit per head,
    # alternating sliding and full layers, and a mixture of experts with a biased router
    # and biased experts, their SwiGLU clamped, stored stacked per layer.
    "gpt_oss": {"qkv_bias": True, "qk_norm": False},
    # DeepSeek V2 and V3: multi-head latent attention (kiln/core/ops/mla.py), and a
    # mixture of experts with shared experts, grouped top-k routing and dense first layers.
    "deepseek_v2": {"qkv_bias": False, "qk_norm": False},
    "deepseek_v3": {"qkv_bias": False, "qk_norm": False},
    # Gemma (1): Gemma 2's layer without its soft caps, sliding layers or sandwich norms.
    "gemma": {"qkv_bias": False, "qk_norm": False},
    # Granite (3.x): Llama's layer with four constants: embeddings times
    # embedding_multiplier, attention scaled by attention_multiplier, each residual branch
    # times residual_multiplier, logits divided by logits_scaling.
    "granite": {"qkv_bias": False, "qk_norm": False},
    # Granite 3 MoE: Granite's multipliers, Mixtral's routing (softmax over the top-k
    # logits), each layer's experts stacked: input_linear [experts, 2 * width, hidden]
    # (gate rows, then up rows), output_linear [experts, hidden, width].
    "granitemoe": {"qkv_bias": False, "qk_norm": False},
    # SmolLM3: Llama's layer, with rope left out of the layers no_rope_layers marks 0.
    "smollm3": {"qkv_bias": False, "qk_norm": False},
    # OLMo 2: norms after attention and after the MLP only (none before), and q/k norms
    # over each whole projection, not per head.
    "olmo2": {"qkv_bias": False, "qk_norm": True},
    # OLMo 3: OLMo 2's layer, three sliding-window layers to a global one, and a rope per
    # layer type (the published 7B and 32B: YaRN on the global layers only).
    "olmo3": {"qkv_bias": False, "qk_norm": True},
    # ERNIE 4.5 (dense): Llama's layer with rope over interleaved pairs (x0, x1), (x2, x3)...
    # (kiln stores each head's q and k rows as halves, where its rope turns them).
    "ernie4_5": {"qkv_bias": False, "qk_norm": False},
    # EXAONE 4: OLMo 2's post norms with per-head q/k norms; with a sliding window, its
    # sliding layers use rope and its global ones none.
    "exaone4": {"qkv_bias": False, "qk_norm": True},
    # StarCoder 2: LayerNorm with biases, biased q/k/v/o, an MLP of one biased GELU-tanh
    # projection up (c_fc) and one down (c_proj), a sliding window over every layer.
    "starcoder2": {"qkv_bias": True, "qk_norm": False},
    # Cohere (Command-R, Aya) and Cohere 2 (Command R7B): attention and MLP side by side
    # from one LayerNorm without bias, rope over interleaved pairs, logits times
    # logit_scale; Cohere 2's sliding layers turn q/k, its global ones do not.
    "cohere": {"qkv_bias": False, "qk_norm": False},
    "cohere2": {"qkv_bias": False, "qk_norm": False},
    # GLM-4 (glm: GLM-4-9B-Chat's converted checkpoints; glm4: the 0414 models): biased
    # q/k/v, rope over interleaved pairs of half of each head, gate/up one tensor; glm4 has
    # Gemma's four norms a layer under names of its own.
    "glm": {"qkv_bias": True, "qk_norm": False},
    "glm4": {"qkv_bias": True, "qk_norm": False},
    # StableLM 2: LayerNorms with biases, rope over a quarter of each head, optional q/k/v
    # biases and (use_parallel_residual) attention and MLP side by side.
    "stablelm": {"qkv_bias": False, "qk_norm": False},
    # Nemotron (Minitron): LayerNorm1P (1 + w, with bias), rope over half of each head, an
    # MLP of up, relu^2 and down; Arcee (AFM): Llama's layer with that MLP.
    "nemotron": {"qkv_bias": False, "qk_norm": False},
    "arcee": {"qkv_bias": False, "qk_norm": False},
    # Phi-2 (phi): attention and an MLP of fc1, GELU-tanh and fc2 side by side from one
    # LayerNorm, biases everywhere (the lm_head's too), rope over part of each head.
    "phi": {"qkv_bias": True, "qk_norm": False},
    # Helium: Llama's layer with rope over interleaved pairs; Seed-OSS: Llama's with q/k/v
    # biases (attention_bias) and optionally o_proj's (attention_out_bias).
    "helium": {"qkv_bias": False, "qk_norm": False},
    "seed_oss": {"qkv_bias": False, "qk_norm": False},
    # OLMoE: Llama's pre-norm layer with OLMo 2's q/k norms over whole projections and
    # Qwen3-MoE's routing (softmax top-k, not rescaled by default), every layer sparse.
    "olmoe": {"qkv_bias": False, "qk_norm": True},
    # GLM-4.5 / 4.6 (glm4_moe): Llama's attention with biased q/k/v, rope over half of each
    # head (halves, not pairs), optional per-head q/k norms; DeepSeek V3's mixture of
    # experts (sigmoid routing, correction bias, a shared expert, dense first layers).
    "glm4_moe": {"qkv_bias": False, "qk_norm": False},
}
_DEEPSEEKS = ("deepseek_v2", "deepseek_v3")
_GLMS = ("glm", "glm4")
_COHERES = ("cohere", "cohere2")
# The rotated share of a head where a config leaves partial_rotary_factor out (transformers'
# defaults for these families).
_ROTARY_DEFAULTS = {
    **dict.fromkeys(("glm", "glm4", "glm4_moe", "nemotron", "phi"), 0.5),
    "stablelm": 0.25,
}
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
# hidden_act / hidden_activation -> kiln's activation op.
# gelu_new is GELU's tanh approximation too (Phi-2's), written out rather than torch's.
_ACTIVATIONS = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu2": "relu2",
}

SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


class ModelConfigError(ValueError):
    """The checkpoint's config.json describes a model kiln cannot build."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # YaRN: the ramp between extrapolated and interpolated frequencies, and the factor the
    # rotary tables are multiplied by.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # LongRoPE (Phi-3): a divisor per frequency for contexts up to the pretraining one
    # (short) and beyond it (long).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # "freq_factors": a divisor per frequency as a GGUF file stores it (llama.cpp's
    # rope_freqs tensor: how its converter writes Llama 3.1's scaling, and EXAONE's).
    freq_factors: tuple[float, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); older files write a
        # top-level `rope_theta` and an optional `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            theta = 10000.0
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's first name for it
        if rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope type {rope_type!r} is not supported yet (supported: {', '.join(ROPE_TYPES)})"
            )
        original = merged.get("original_max_position_embeddings")
        factor = merged.get("factor")
        extra: dict[str, Any] = {}
        if rope_type == "yarn":
            # As transformers reads YaRN: the pretraining context defaults to the config's,
            # the factor to the ratio of the two, the attention factor to its mscale rule.
            original = int(original or cfg.get("max_position_embeddings") or 2048)
            if factor is None:
                factor = (cfg.get("max_position_embeddings") or original) / original
            extra = {
                "beta_fast": float(merged.get("beta_fast") or 32.0),
                "beta_slow": float(merged.get("beta_slow") or 1.0),
                "truncate": bool(merged.get("truncate", True)),
                "attention_factor": _yarn_attention_factor(merged, float(factor)),
            }
        if rope_type == "longrope":
            original = int(original or cfg.get("original_max_position_embeddings") or 0)
            if not original:
                raise ModelConfigError("longrope needs original_max_position_embeddings")
            if factor is None:
                factor = (cfg.get("max_position_embeddings") or original) / original
            if not merged.get("short_factor") or not merged.get("long_factor"):
                raise ModelConfigError("longrope needs short_factor and long_factor")
            extra = {
                "short_factor": tuple(float(f) for f in merged["short_factor"]),
                "long_factor": tuple(float(f) for f in merged["long_factor"]),
                "attention_factor": _longrope_attention_factor(merged, float(factor), original),
            }
        if rope_type == "freq_factors":
            factors = merged.get("freq_factors") or ()
            if not factors or not all(isinstance(f, (int, float)) and f > 0 for f in factors):
                raise ModelConfigError("freq_factors rope needs positive freq_factors")
            extra = {"freq_factors": tuple(float(f) for f in factors)}
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            **extra,
        )


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")


def _longrope_attention_factor(params: dict[str, Any], factor: float, original: int) -> float:
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    given = params.get("attention_factor")
    if given is not None:
        return float(given)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def _matryoshka(cfg: dict[str, Any]) -> tuple[bool, tuple[int, ...]]:
    """Whether config.json says the model is a Matryoshka embedding model (is_matryoshka,
    or a list of matryoshka_dimensions), and the widths it was trained to be cut to
    (empty: any)."""
    dims = cfg.get("matryoshka_dimensions") or []
    if not isinstance(dims, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims
    ):
        raise ModelConfigError(f"matryoshka_dimensions {dims!r}: a list of positive integers")
    if cfg.get("is_matryoshka") not in (None, True, False):
        raise ModelConfigError(f"is_matryoshka {cfg['is_matryoshka']!r}: true or false")
    return bool(cfg.get("is_matryoshka")) or bool(dims), tuple(sorted(set(dims)))


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A sequence classifier's label names in id order: config.json's id2label, else
    transformers' LABEL_i for its num_labels (2 unless given); () for other models."""
    arch = (cfg.get("architectures") or [""])[0]
    if not arch.endswith("ForSequenceClassification"):
        return ()
    names = cfg.get("id2label") or {}
    try:
        by_id = {int(k): str(v) for k, v in names.items()}
    except (TypeError, ValueError, AttributeError):
        raise ModelConfigError(f"id2label {names!r}: a mapping of label ids to names") from None
    count = len(by_id) or int(cfg.get("num_labels") or 2)
    if sorted(by_id) not in ([], list(range(count))):
        raise ModelConfigError(f"id2label: ids {sorted(by_id)}, not 0..{count - 1}")
    return tuple(by_id.get(i, f"LABEL_{i}") for i in range(count))


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The fields of `config.json` in a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ModelConfigError(f"no config.json in {path}: not a Hugging Face checkpoint")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{file} is not a JSON object")
    return cfg


# An EAGLE draft head's architectures: EAGLE (1 and 2) and EAGLE-3, as SGLang loads them.
EAGLE_ARCHITECTURES = {"LlamaForCausalLMEagle": "EAGLE", "LlamaForCausalLMEagle3": "EAGLE3"}
# Models whose checkpoints hold a multi-token-prediction layer that drafts as an EAGLE
# head (SGLang's NEXTN, which it runs as EAGLE): the layer after the last, its weights
# under model.layers.<num_hidden_layers>.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


@dataclass(frozen=True)
class EagleTap:
    """What a model compiled for an EAGLE draft returns besides its logits, for every row:
    EAGLE's, its final norm's output; EAGLE-3's, the draft's fc over the residual stream
    entering each of `layers` (the number of layers: the last one's output)."""

    layers: tuple[int, ...] = ()
    hidden_size: int = 0  # EAGLE-3: the draft's hidden size (fc's output)
    fc_bias: bool = False


@dataclass(frozen=True)
class EagleHead:
    """An EAGLE draft head's checkpoint, read from its config.json and weight names."""

    algorithm: str  # EAGLE or EAGLE3
    draft_vocab_size: int  # EAGLE-3's lm_head may cover the most frequent tokens only
    fc_bias: bool
    own_lm_head: bool  # EAGLE-3's own lm_head (else the model's)
    layers: tuple[int, ...] = ()  # EAGLE-3's taps (EagleTap.layers)
    mtp: int | None = None  # a model's own MTP layer: its index (num_hidden_layers)

    @classmethod
    def read(cls, hf: dict[str, Any], names: set[str], model_layers: int) -> EagleHead:
        """`names`: the head checkpoint's tensor names, without a `model.` prefix."""
        arch = (hf.get("architectures") or [""])[0]
        algorithm = EAGLE_ARCHITECTURES.get(arch)
        if algorithm is None:
            raise ModelConfigError(
                f"architectures {arch!r} is not an EAGLE draft head "
                f"({', '.join(EAGLE_ARCHITECTURES)})"
            )
        if int(hf.get("num_hidden_layers", 1)) != 1:
            raise ModelConfigError(
                f"an EAGLE head of {hf['num_hidden_layers']} layers; kiln's have one (as SGLang's)"
            )
        layers: tuple[int, ...] = ()
        if algorithm == "EAGLE3":
            ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            # SGLang's: the stream entering layers 2, L/2 and L-3; a head's config names the
            # layers whose output it read (so the stream entering the next one)
            wanted = [int(i) + 1 for i in ids] if ids else [2, model_layers // 2, model_layers - 3]
            if any(not 0 <= i <= model_layers for i in wanted) or len(set(wanted)) != len(wanted):
                raise ModelConfigError(
                    f"EAGLE-3 taps the model's layers {wanted}: the model has {model_layers}"
                )
            layers = tuple(wanted)
        vocab = int(hf.get("draft_vocab_size") or hf["vocab_size"])
        # SGLang's: EAGLE-3's fc has a bias where the config says `bias`; EAGLE's where the
        # head has one
        bias = bool(hf.get("bias", False)) if algorithm == "EAGLE3" else "fc.bias" in names
        return cls(algorithm, vocab, bias, "lm_head.weight" in names, layers)

    @classmethod
    def mtp_of(cls, cfg: ModelConfig, hf: dict[str, Any]) -> EagleHead:
        """The MTP layer of a model's own checkpoint (MTP_ARCHITECTURES) as a head."""
        if not int(hf.get("num_nextn_predict_layers") or 0):
            raise ModelConfigError(
                f"{cfg.architecture} without a multi-token-prediction layer "
                "(num_nextn_predict_layers is 0): name an EAGLE head"
            )
        return cls("EAGLE", cfg.vocab_size, False, False, mtp=cfg.num_layers)

    def mtp_config(self, cfg: ModelConfig, hf: dict[str, Any]) -> ModelConfig:
        """The model's config as its MTP layer's: one layer, as layer `mtp` would be."""
        assert self.mtp is not None
        sparse = _moe(cfg.model_type, hf, self.mtp + 1)["sparse_layers"][self.mtp]
        return dataclasses.replace(
            cfg,
            num_layers=1,
            sliding_windows=(None,),
            sparse_layers=(sparse,) if cfg.sparse_layers else (),
            rope_layers=(),
        )

    def tap(self, hidden_size: int) -> EagleTap:
        return EagleTap(self.layers, hidden_size, self.fc_bias)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer, read once from config.json."""

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # One entry per layer: the window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (mixtral, qwen3_moe): experts a sparse layer has, how many a token
    # runs, each one's MLP width, whether the k router weights are rescaled to sum to 1,
    # and which layers are sparse (the others keep the dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()
    # Gemma: the MLP's activation op, a constant norms add to their weight (they scale by
    # 1 + w), norms after attention and MLP as well as before ("sandwich"), the embeddings'
    # factor, the attention's scale (query_pre_attn_scalar ** -0.5), and the rope of the
    # sliding-window layers when it differs from the global one.
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_scale: float | None = None
    local_rope: RopeConfig | None = None
    # Gemma 2: attention scores and final logits held inside (-cap, cap); 0: no cap.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj; GLM: gate/up only);
    # rope over the first rotary_dim features of each head (Phi-4-mini: 3/4 of them, GLM:
    # half), the rest passed through.
    fused_qkv: bool = False
    fused_gate_up: bool = False
    rotary_dim: int = 0
    # A bias on o_proj too (transformers' attention_bias: Llama's, Qwen3's, GPT-OSS's).
    o_bias: bool = False
    # StarCoder 2: LayerNorm (weight and bias) in place of RMSNorm; an MLP of one projection
    # up and one down around the activation (not gated), with biases.
    layer_norm: bool = False
    gated_mlp: bool = True
    mlp_bias: bool = False
    # Cohere: a LayerNorm without bias; attention and MLP both read the layer's one input
    # norm, and both outputs join the residual (h + attn + mlp).
    norm_bias: bool = True
    parallel_block: bool = False
    # Phi-2: a bias on the lm_head.
    lm_head_bias: bool = False
    # GPT-OSS: per-head attention sinks; the router's bias, the experts' biases and their
    # clamped SwiGLU (limit, alpha); experts stored stacked ([experts, in, out] tensors).
    attn_sinks: bool = False
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    stacked_experts: bool = False
    # DeepSeek's multi-head latent attention (kv_lora_rank > 0): q straight from hidden
    # (q_lora_rank 0) or through its own low-rank projection and norm; the latent's width;
    # each head's key split into a part without rope and a rope part, and its value width;
    # rope's pairs stored interleaved (kiln stores them as halves, models/decoder.py).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    mla_scale: float = 0.0
    # DeepSeek's routing: router scores by softmax (V2) or sigmoid (V3, with a bias that
    # only picks experts); top-k within the topk_group best of n_group groups, each group
    # scored by its best expert (V2) or its two best (V3); the weights times
    # routed_scaling_factor; a shared MLP of n_shared_experts experts' width beside.
    moe_scoring: str = "softmax"
    n_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    n_shared_experts: int = 0
    # Qwen2-MoE: the width of its one shared expert, whose output a per-token sigmoid gate
    # scales (0: none).
    shared_expert_size: int = 0
    # An embedding model trained for Matryoshka truncation (config.json's is_matryoshka or
    # matryoshka_dimensions, as vLLM reads them): a request's `dimensions` keeps the first
    # d features of the pooled vector (any d up to hidden_size, or one of those listed).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # Granite: each residual branch (attention's, the MLP's) times residual_scale before
    # it is added; the logits times logits_scale (1 / logits_scaling).
    residual_scale: float = 1.0
    logits_scale: float = 1.0
    # SmolLM3: per layer, whether rope turns its q and k (empty: every layer's does).
    rope_layers: tuple[bool, ...] = ()
    # OLMo 2: a norm after attention and after the MLP, none before; q/k norms over the
    # whole q and k projections (qk_norm_heads False) rather than each head.
    post_norms: bool = False
    qk_norm_heads: bool = True
    # A LayerNorm over each head of q and k before rope (Phi's qk_layernorm, one all heads
    # share; StableLM's qk_layernorm and Cohere's use_qk_norm, a weight for each head).
    qk_layernorm: bool = False
    # A sequence classifier or reward model (architectures' *ForSequenceClassification):
    # a `score` linear (hidden -> one logit a label, no bias) over the last token's final
    # hidden state in place of the lm_head; each label's name (config.json's id2label).
    labels: tuple[str, ...] = ()

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        return cls.from_dict(read_hf_config(path))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        is_matryoshka, matryoshka = _matryoshka(cfg)  # a multimodal model's are top-level
        cfg = _text_part(cfg)
        model_type = cfg.get("model_type", "")
        if model_type not in _FAMILIES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if model_type == "gemma" and act == "gelu":  # a legacy value meaning tanh's, as
            act = "gelu_pytorch_tanh"  # transformers reads Gemma's configs
        if act not in _ACTIVATIONS:
            raise ModelConfigError(
                f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
            )
        if cfg.get("mlp_bias") and model_type not in ("nemotron", "arcee"):  # a gated MLP's
            raise ModelConfigError("mlp_bias=true is not supported yet")
        if model_type == "ernie4_5" and cfg.get("use_bias"):
            raise ModelConfigError("ernie4_5 with use_bias=true is not supported yet")
        family = _FAMILIES[model_type]
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if model_type in _DEEPSEEKS:  # the rope tables' width: the rope part of a head
            head_dim = cfg["qk_rope_head_dim"]
        qkv_bias = family["qkv_bias"] or bool(cfg.get("attention_bias", False))
        if model_type == "qwen2_moe":  # its config says (True unless written otherwise)
            qkv_bias = bool(cfg.get("qkv_bias", True))
        if model_type in _GLMS:  # transformers' default: biased
            qkv_bias = bool(cfg.get("attention_bias", True))
        # Qwen2's and GLM's o_proj have no bias whatever attention_bias says.
        no_o_bias = ("qwen2", *_GLMS, "glm4_moe", "helium")
        o_bias = bool(cfg.get("attention_bias", False)) and model_type not in no_o_bias
        if model_type == "starcoder2":  # use_bias: every projection's
            qkv_bias = o_bias = bool(cfg.get("use_bias", True))
        if model_type == "stablelm":
            qkv_bias = bool(cfg.get("use_qkv_bias", False))
        if model_type == "phi":  # every projection biased
            o_bias = True
        if model_type == "seed_oss":  # biased q/k/v by default, o_proj on its own flag
            qkv_bias = bool(cfg.get("attention_bias", True))
            o_bias = bool(cfg.get("attention_out_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        windows = _sliding_windows(cfg, num_layers)
        out = cls(
            model_type=model_type,
            architecture=(cfg.get("architectures") or [""])[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=_norm_eps(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(_global_rope(model_type, cfg)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in _GEMMAS)),
            qkv_bias=qkv_bias,
            qk_norm=family["qk_norm"] or bool(model_type == "glm4_moe" and cfg.get("use_qk_norm")),
            sliding_windows=windows,
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe(model_type, cfg, num_layers),
            hidden_act=_ACTIVATIONS[act],
            **_gemma(model_type, cfg, hidden),
            # norms before and after attention and the MLP
            sandwich_norms=model_type in ("gemma2", "gemma3_text", "glm4"),
            fused_qkv=model_type == "phi3",
            fused_gate_up=model_type in ("phi3", *_GLMS),
            rotary_dim=_rotary_dim(cfg, int(head_dim), _ROTARY_DEFAULTS.get(model_type, 1.0)),
            o_bias=o_bias,
            **_cohere(model_type, cfg),
            **_layer_norm_families(model_type, cfg),
            **_gpt_oss(model_type, cfg),
            **_deepseek(model_type, cfg, _global_rope(model_type, cfg)),
            **_deepseek_routing(model_type, cfg),
            **_granite(model_type, cfg),
            rope_layers=_rope_layers(model_type, cfg, windows),
            post_norms=model_type in ("olmo2", "olmo3", "exaone4"),
            qk_norm_heads=model_type not in ("olmo2", "olmo3", "olmoe"),
            **_olmo3(model_type, cfg),
            is_matryoshka=is_matryoshka,
            matryoshka_dimensions=matryoshka,
            labels=_labels(cfg),
        )
        if any(d > out.hidden_size for d in matryoshka):
            raise ModelConfigError(
                f"matryoshka_dimensions {list(matryoshka)}: past hidden_size {out.hidden_size}"
            )
        pairs = out.rotary // 2
        factors = (len(out.rope.short_factor), len(out.rope.long_factor))
        if out.rope.rope_type == "longrope" and factors != (pairs, pairs):
            raise ModelConfigError(
                f"longrope has {factors[0]} short and {factors[1]} long factors for "
                f"{pairs} rotary pairs"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_manifest(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["sliding_windows"] = tuple(d["sliding_windows"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["sparse_layers"] = tuple(d.get("sparse_layers", ()))
        d["rope_layers"] = tuple(d.get("rope_layers", ()))
        d["matryoshka_dimensions"] = tuple(d.get("matryoshka_dimensions", ()))
        d["labels"] = tuple(d.get("labels", ()))
        d["rope"] = _rope_from_manifest(d["rope"])
        if d.get("local_rope") is not None:
            d["local_rope"] = _rope_from_manifest(d["local_rope"])
        return cls(**d)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def rotary(self) -> int:
        """Features of each head that rope turns (the first ones)."""
        return self.rotary_dim or self.head_dim

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope of layer `layer`: the sliding layers' own where the model has one."""
        local = self.local_rope is not None and self.sliding_windows[layer] is not None
        return self.local_rope if local and self.local_rope is not None else self.rope


def _rope_from_manifest(d: dict[str, Any]) -> RopeConfig:
    d = dict(d)
    for k in ("short_factor", "long_factor", "freq_factors"):
        d[k] = tuple(d.get(k, ()))
    return RopeConfig(**d)


def _rotary_dim(cfg: dict[str, Any], head_dim: int, default: float = 1.0) -> int:
    """0 (the whole head) or the rotated features' count: partial_rotary_factor, top level
    (transformers < 5) or in rope_parameters (`default` where neither says)."""
    params = cfg.get("rope_parameters") or {}
    part = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    if part is None or float(part) == 1.0:
        return 0
    dim = int(head_dim * float(part))
    if not 0 < dim < head_dim or dim % 2:
        raise ModelConfigError(
            f"partial_rotary_factor {part} gives {dim} rotary features of a {head_dim}-wide "
            "head; kiln needs an even count below it"
        )
    return dim


def _moe(model_type: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields, as transformers reads them for each family."""
    if model_type in ("mixtral", "granitemoe"):
        experts = int(cfg.get("num_local_experts", 8))
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,  # both always rescale their top-k weights
            "sparse_layers": (True,) * num_layers,
        }
    if model_type in (*_DEEPSEEKS, "glm4_moe"):
        routed = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
        first_sparse = int(cfg.get("first_k_dense_replace", 0))
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        return {
            "num_experts": routed,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 1)),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 0)),
            # transformers' V2 router never rescales (whatever norm_topk_prob says); V3's
            # does when asked (GLM-4.5's unless told not to).
            "norm_topk_prob": model_type != "deepseek_v2"
            and bool(cfg.get("norm_topk_prob", model_type == "glm4_moe")),
            "sparse_layers": tuple(
                routed > 0 and i >= first_sparse and i % freq == 0 for i in range(num_layers)
            ),
        }
    if model_type == "gpt_oss":
        # Top-k of the router's logits, softmax over those k: the renormalised top-k of the
        # softmax over all.
        return {
            "num_experts": int(cfg["num_local_experts"]),
            "num_experts_per_tok": int(
                cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4
            ),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
            "sparse_layers": (True,) * num_layers,
        }
    if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
        if cfg.get("clip_qkv") is not None:  # OLMoE's q/k/v clamped: no op for it yet
            raise ModelConfigError(f"{model_type} with clip_qkv is not supported yet")
        # Qwen's own files write num_experts; transformers >= 5 writes num_local_experts.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        dense = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 1)),
            # OLMoE's experts are intermediate_size wide
            "moe_intermediate_size": int(
                cfg["intermediate_size"]
                if model_type == "olmoe"
                else cfg.get("moe_intermediate_size", 0)
            ),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "sparse_layers": tuple(
                i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
            ),
            "shared_expert_size": int(cfg.get("shared_expert_intermediate_size") or 0),
        }
    return {}


def _deepseek(model_type: str, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    if model_type in ("ernie4_5", *_GLMS, "helium"):  # rope pairs interleaved, as DeepSeek's
        return {"rope_interleave": True}
    if model_type not in _DEEPSEEKS:
        return {}
    if cfg.get("attention_bias"):
        raise ModelConfigError("attention_bias=true is not supported for DeepSeek")
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope_dim) ** -0.5
    params = {**(rope.get("rope_scaling") or {}), **(rope.get("rope_parameters") or {})}
    if params.get("rope_type", params.get("type", "default")) != "default":
        # DeepSeek's YaRN also sharpens the softmax by mscale(factor, mscale_all_dim)^2.
        m_all = float(params.get("mscale_all_dim") or 0.0)
        factor = float(params.get("factor") or 1.0)
        if m_all and factor > 1:
            scale *= (0.1 * m_all * math.log(factor) + 1.0) ** 2
    v3 = model_type == "deepseek_v3"
    return {
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": int(cfg["v_head_dim"]),
        # V2's rope is complex multiplication over (even, odd) pairs; V3 says which.
        "rope_interleave": bool(cfg.get("rope_interleave", True)) if v3 else True,
        "mla_scale": scale,
    }


def _deepseek_routing(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's mixture of experts (V2's, V3's; GLM-4.5's is V3's)."""
    if model_type not in (*_DEEPSEEKS, "glm4_moe"):
        return {}
    v3 = model_type != "deepseek_v2"
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    grouped = method in ("group_limited_greedy", "noaux_tc")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ModelConfigError(f"topk_method {method!r} is not supported")
    return {
        "moe_scoring": "sigmoid" if v3 else "softmax",
        "n_group": int(cfg.get("n_group") or 1) if grouped else 0,
        "topk_group": int(cfg.get("topk_group") or 1) if grouped else 0,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "score_correction_bias": v3,
        "n_shared_experts": int(cfg.get("n_shared_experts") or 0),
    }


def _norm_eps(cfg: dict[str, Any]) -> float:
    """The norms' epsilon, under each family's key."""
    for key in ("rms_norm_eps", "norm_epsilon", "layer_norm_eps", "norm_eps"):
        if cfg.get(key) is not None:
            return float(cfg[key])
    return 1e-6


def _layer_norm_families(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The LayerNorm families' fields (StarCoder 2, StableLM, Nemotron, Phi-2) and the
    plain MLPs' (theirs but StableLM's; Arcee's)."""
    if model_type == "starcoder2":
        return {"layer_norm": True, "gated_mlp": False, "mlp_bias": bool(cfg.get("use_bias", True))}
    if model_type == "stablelm":  # StableLM 2 12B: LayerNorms over each head of q and k
        return {
            "layer_norm": True,
            "parallel_block": bool(cfg.get("use_parallel_residual")),
            "qk_layernorm": bool(cfg.get("qk_layernorm")),
        }
    mlp = {"gated_mlp": False, "mlp_bias": bool(cfg.get("mlp_bias", False))}
    if model_type == "nemotron":  # LayerNorm1P: the weight plus one
        return {"layer_norm": True, "norm_offset": 1.0, **mlp}
    if model_type == "arcee":
        return mlp
    if model_type == "phi":
        return {
            "qk_layernorm": bool(cfg.get("qk_layernorm")),
            "layer_norm": True,
            "parallel_block": True,
            "gated_mlp": False,
            "mlp_bias": True,
            "lm_head_bias": True,
        }
    return {}


def _cohere(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if model_type not in _COHERES:
        return {}
    return {
        # Command R+'s (Cohere 2 has none)
        "qk_layernorm": model_type == "cohere" and bool(cfg.get("use_qk_norm")),
        "layer_norm": True,
        "norm_bias": False,
        "parallel_block": True,
        "rope_interleave": True,
        "logits_scale": float(cfg.get("logit_scale", 0.0625)),
    }


def _gpt_oss(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if model_type != "gpt_oss":
        return {}
    return {
        "attn_sinks": True,
        "router_bias": True,
        "expert_biases": True,
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "stacked_experts": True,
    }


def _text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language model config (Gemma3ForConditionalGeneration:
    model_type gemma3 with a text_config); kiln runs the text part, and the compiler reads
    its weights under the text model's names (compiler/checkpoint.py)."""
    text = cfg.get("text_config")
    if cfg.get("model_type") != "gemma3" or not isinstance(text, dict):
        return cfg
    tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return {
        **text,
        "model_type": "gemma3_text",
        "architectures": cfg.get("architectures") or ["Gemma3ForConditionalGeneration"],
        "tie_word_embeddings": tied,
    }


def _global_rope(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config's rope fields for the full-attention layers: Gemma 3 writes one rope per
    layer type in `rope_parameters` (transformers >= 5)."""
    params = cfg.get("rope_parameters") or {}
    if model_type in ("gemma3_text", "olmo3") and "full_attention" in params:
        return {"rope_parameters": params["full_attention"]}
    return cfg


def _olmo3(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's sliding layers' own rope where it is not the global layers' (its 7B and 32B:
    YaRN on the global layers only, a config's top-level rope_scaling too, as transformers
    reads one; the sliding layers the plain rope of the same base)."""
    if model_type != "olmo3":
        return {}
    full = RopeConfig.from_hf(_global_rope(model_type, cfg))
    local = _sliding_rope(cfg, full.theta)
    return {"local_rope": local} if local != full else {}


def _granite(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if model_type not in ("granite", "granitemoe"):
        return {}
    out = {
        "embed_scale": float(cfg.get("embedding_multiplier", 1.0)),
        "query_scale": float(cfg.get("attention_multiplier", 1.0)),
        "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
        "logits_scale": 1.0 / float(cfg.get("logits_scaling", 1.0)),
    }
    if not all(math.isfinite(v) and v > 0 for v in out.values()):
        raise ModelConfigError(f"granite's multipliers must be positive: {out}")
    return out


def _rope_layers(
    model_type: str, cfg: dict[str, Any], windows: tuple[int | None, ...]
) -> tuple[bool, ...]:
    """SmolLM3's no_rope_layers (1: the layer uses rope, 0: it does not), as booleans;
    unset, every no_rope_layer_interval-th layer (4) goes without, as transformers fills it.
    EXAONE 4 with a sliding window: its sliding layers only."""
    if model_type == "exaone4":
        if cfg.get("sliding_window") is None:
            return ()
        return tuple(w is not None for w in windows)
    if model_type == "cohere2":  # rope where the layer slides, as transformers turns it
        return tuple(w is not None for w in windows)
    if model_type != "smollm3":
        return ()
    marks = cfg.get("no_rope_layers")
    if marks is None:
        every = int(cfg.get("no_rope_layer_interval") or 4)
        marks = [(i + 1) % every != 0 for i in range(len(windows))]
    if len(marks) != len(windows):
        raise ModelConfigError(f"no_rope_layers has {len(marks)} entries for {len(windows)} layers")
    return tuple(bool(m) for m in marks)


def _gemma(model_type: str, cfg: dict[str, Any], hidden: int) -> dict[str, Any]:
    if model_type not in _GEMMAS:
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true is not supported")
    if model_type == "gemma":  # pre-norms only, the head's own scale, no caps
        return {"norm_offset": 1.0, "embed_scale": math.sqrt(hidden)}
    out = {
        "norm_offset": 1.0,
        "embed_scale": math.sqrt(hidden),
        "query_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_softcap": float(cfg.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
    }
    if model_type == "gemma3_text":
        out["local_rope"] = _sliding_rope(cfg, cfg.get("rope_local_base_freq", 10000.0))
    return out


def _sliding_rope(cfg: dict[str, Any], theta: float) -> RopeConfig:
    """The sliding layers' rope of a config with one a layer type (transformers >= 5's
    `rope_parameters`), else plain rope of base `theta`."""
    params = cfg.get("rope_parameters") or {}
    return RopeConfig.from_hf(
        {"rope_parameters": params.get("sliding_attention") or {"rope_theta": theta}}
    )


def _sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if not layer_types and cfg.get("model_type") in ("gemma2", "gpt_oss"):
        pattern = 2  # transformers' Gemma 2 and GPT-OSS: sliding and full layers alternate
    if not layer_types and cfg.get("model_type") == "cohere2":
        pattern = pattern or 4  # transformers' default: three sliding layers, one global
    patterned = (*_GEMMAS, "gpt_oss", "exaone4", "cohere2")
    if not layer_types and cfg.get("model_type") in patterned and pattern:
        # Older Gemma files: every pattern-th layer is global, the others slide.
        layer_types = [
            "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if layer_types:
        if len(layer_types) != num_layers:
            raise ModelConfigError(
                f"layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Qwen2 writes a window but only applies it with use_sliding_window; Mistral always does.
    if window is None or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    return (int(window),) * num_layers
