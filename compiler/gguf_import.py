"""GGUF checkpoints (llama.cpp's single-file format) as a kiln compile input.

Three things come out of one `.gguf` file, each in the form the rest of the compiler already
reads from a Hugging Face folder:

- a `config.json`-shaped dict from the file's metadata (`hf_config`);
- tokenizer files (`write_tokenizer`): a `tokenizer.json` that the `tokenizers` library
  loads, and a `tokenizer_config.json` with the chat template and special tokens;
- tensors under Hugging Face names (`GGUFTensors`), as float (`get`, dequantized) or, for
  block formats kiln runs as they are, as the raw blocks (`raw`).

compiler/gguf_read.py parses the file; the `gguf` package does the block maths of every
quantization type; this module maps names, layouts and metadata.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kiln.compiler.ckpt_files import CheckpointError, find_gguf
from kiln.compiler.gguf_read import GGUFContents, GGUFReadError, TensorRecord, read

__all__ = ["ARCHITECTURES", "GGUFFile", "find_gguf"]

# GGUF architectures kiln builds, and the Hugging Face model_type each becomes.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek2",  # deepseek_v2 or deepseek_v3, by its gating function
    "gemma": "gemma",
    "granite": "granite",
    "granitemoe": "granitemoe",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "ernie4_5": "ernie4_5",
    "exaone4": "exaone4",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "glm4": "glm4",
    "starcoder2": "starcoder2",
    "command-r": "cohere",
    "cohere2": "cohere2",
    "stablelm": "stablelm",
    "nemotron": "nemotron",
    "arcee": "arcee",
    "olmoe": "olmoe",
    "phi2": "phi",
}
# llama.cpp's converter stores Gemma's norm weights as 1 + w (its norm multiplies by the
# weight); transformers' Gemma norms take w and add the 1 themselves, as kiln's do.
_NORMS_PLUS_ONE = ("gemma", "gemma2", "gemma3")
# ... and Nemotron's LayerNorm1P weights (its converter adds the 1 its norm then omits).
_STORED_PLUS_ONE = (*_NORMS_PLUS_ONE, "nemotron")
_SANDWICH = ("gemma2", "gemma3")  # norms before and after attention and MLP
# llama.cpp's converter interleaves the rotary halves of q/k for these (its rope is the
# GPT-J pairing); kiln's models rotate halves as transformers does, so the rows go back.
_PERMUTED_QK = ("llama", "mistral", "granite", "granitemoe", "smollm3", "arcee")

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`; the ones not listed use GPT-2's,
# which the `tokenizers` ByteLevel pre-tokenizer applies itself.
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _LETTERS + r"\p{N}{1,3}|" + _REST
# Upper-then-lower letter runs (the original expressions of these tokenizers' own files).
_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+%s|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*%s|"
)
_CASED_REST = r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# llama.cpp's names for the same splits share an entry (llama-vocab.cpp's table).
_SPLIT_PATTERNS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("chatglm-bpe", "glm4", "glm5"), _LLAMA3),  # GLM-4's (llama.cpp's CHATGLM4)
    **dict.fromkeys(("dbrx", "smaug-bpe"), _LLAMA3),  # OLMo 2's (cl100k)
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _LETTERS + r"\p{N}|" + _REST),
    # Phi-4-mini's and Llama 4's
    "gpt-4o": _CASED % (_CONTRACTION, _CONTRACTION) + r"\p{N}{1,3}|" + _CASED_REST,
    # Mistral Nemo's and Small 3's
    "tekken": _CASED % ("", "") + r"\p{N}|" + _CASED_REST,
}
# llama.cpp takes a whole pre-token that is in the vocabulary as one token before merging
# for these (as Llama 3's own tokenizer file says, ignore_merges).
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "glm4", "glm5")
_GPT2_PRE = ("default", "gpt2", "smollm", "gpt-2", "olmo", "exaone4")
# llama.cpp's pre-tokenizers that isolate every digit, then split as GPT-2 does (Granite
# 3's files carry "refact" or "starcoder"; llama.cpp reads "smollm" so too, where kiln keeps
# GPT-2's split alone: SmolLM2's vocabulary has no token of an ASCII digit and more).
_DIGITS_THEN_GPT2 = ("refact", "starcoder", "command-r", "codeshell", "exaone", "minerva")

# GGUF tensor names -> transformers' names, per layer and global.
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # LayerNorm's (StarCoder 2)
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",  # Phi-2's
}
# Phi-2's final norm (its own name) with its bias.
_PHI2_GLOBAL = {
    **_GLOBAL,
    "output_norm.weight": "model.final_layernorm.weight",
    "output_norm.bias": "model.final_layernorm.bias",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's sandwich norms: llama.cpp's ffn_norm is its pre-MLP norm, and the norms after
# attention and MLP have names of their own.
_GEMMA_LAYER = {
    **_LAYER,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: q/k/v fused as transformers' checkpoints have them, gate and up fused under ffn_up.
_PHI3_LAYER = {
    **_LAYER,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# GPT-OSS: norms under llama.cpp's names, sinks, a biased router, and the experts stacked
# with gate and up apart ([experts, out, in]); the stacked tensors' names here are kiln's
# own, the model reads what `GGUFFile.derived` makes of them.
_GPT_OSS_LAYER = {
    **_LAYER,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{
        f"ffn_{p}_exps.{k}": f"mlp.experts.{p}_exps.{k}"
        for p in ("gate", "up", "down")
        for k in ("weight", "bias")
    },
}
# DeepSeek V2 / V3: latent attention's projections, kv_b stored as its absorbed halves
# (attn_k_b [heads, latent, nope], attn_v_b [heads, v, latent]), the router and V3's
# correction bias, shared experts, and the routed ones stacked.
_DEEPSEEK_LAYER = {
    **_LAYER,
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **{
        f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight"
        for p in ("gate", "up", "down")
    },
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{p}_exps" for p in ("gate", "up", "down")},
}
_MLP_PARTS = ("gate", "up", "down")
# Qwen2-MoE / Qwen3-MoE: the router, the routed experts stacked, Qwen2-MoE's shared expert
# and its gate (a vector in the file, one row to the model: see `derived`).
_QWEN_MOE_LAYER = {
    **_LAYER,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.vector",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in _MLP_PARTS},
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{p}_exps" for p in _MLP_PARTS},
}
_QWEN_MOES = ("qwen2moe", "qwen3moe", "olmoe")
# Granite MoE: the router and the experts stacked (gate and up apart, as llama.cpp's
# converter splits the checkpoint's input_linear; joined again as derived tensors).
_GRANITE_MOE_LAYER = {
    **_LAYER,
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    **{f"ffn_{p}_exps.weight": f"block_sparse_moe.{p}_exps" for p in _MLP_PARTS},
}
# The MLP's activation where it is not SiLU (the file does not say; llama.cpp's per arch).
_HIDDEN_ACT = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "starcoder2"), "gelu_pytorch_tanh"),
    "phi2": "gelu_new",
    **dict.fromkeys(("nemotron", "arcee"), "relu2"),
}
# Architectures that turn only part of each head (rope.dimension_count of its features).
_PARTIAL_ROTARY = ("phi3", "glm4", "stablelm", "nemotron", "phi2")
# Architectures whose norms are LayerNorms (their epsilon under layer_norm_epsilon).
_LAYER_NORM_ARCHS = ("starcoder2", "command-r", "cohere2", "stablelm", "nemotron", "phi2")
# GLM-4 (0414): Gemma's four norms under llama.cpp's names (its ffn_norm the MLP's input
# norm, GLM's post_attention_layernorm), gate and up fused under ffn_up; q/k rows as the
# checkpoint has them (llama.cpp turns GLM's interleaved pairs itself).
_GLM4_LAYER = {
    **_LAYER,
    "post_attention_norm.weight": "post_self_attn_layernorm.weight",
    "post_ffw_norm.weight": "post_mlp_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# StableLM's and Nemotron's LayerNorms with biases, o_proj's bias, a plain MLP's biases.
_LAYER_NORM_LAYER = {
    **_LAYER,
    "attn_norm.bias": "input_layernorm.bias",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
# StarCoder 2's: the same, its plain MLP named c_fc and c_proj.
_STARCODER2_LAYER = {
    **_LAYER_NORM_LAYER,
    **{f"ffn_up.{k}": f"mlp.c_fc.{k}" for k in ("weight", "bias")},
    **{f"ffn_down.{k}": f"mlp.c_proj.{k}" for k in ("weight", "bias")},
}
# Phi-2: the same LayerNorms and biases, o_proj named dense, the MLP fc1 and fc2.
_PHI2_LAYER = {
    **_LAYER_NORM_LAYER,
    **{f"attn_output.{k}": f"self_attn.dense.{k}" for k in ("weight", "bias")},
    **{f"ffn_up.{k}": f"mlp.fc1.{k}" for k in ("weight", "bias")},
    **{f"ffn_down.{k}": f"mlp.fc2.{k}" for k in ("weight", "bias")},
}
# OLMo 2: norms after attention and after the MLP, none before.
_OLMO2_LAYER = {
    **_LAYER,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYERS = {
    "gpt-oss": _GPT_OSS_LAYER,
    "deepseek2": _DEEPSEEK_LAYER,
    "phi3": _PHI3_LAYER,
    "olmo2": _OLMO2_LAYER,
    "exaone4": _OLMO2_LAYER,  # the same post norms and q/k norms
    **{arch: _QWEN_MOE_LAYER for arch in _QWEN_MOES},
    "glm4": _GLM4_LAYER,
    "starcoder2": _STARCODER2_LAYER,
    **dict.fromkeys(("stablelm", "nemotron"), _LAYER_NORM_LAYER),
    "phi2": _PHI2_LAYER,
    "granitemoe": _GRANITE_MOE_LAYER,
    **{arch: _GEMMA_LAYER for arch in _SANDWICH},
}
# LongRoPE's factors, stored as tensors (read into the config, not weights).
_ROPE_FACTORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}
# A divisor per rope frequency (llama.cpp's converter writes Llama 3.1's scaling so, and
# EXAONE's): read into the config as the "freq_factors" rope.
_FREQ_FACTORS = "rope_freqs.weight"
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Layer counts of the 27B Gemmas, whose query scale is hidden / heads, not head_dim.
_GEMMA_27B_LAYERS = {"gemma2": (46,), "gemma3": (62,)}

# Token types of the GGUF vocabulary (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4


@lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int) -> GGUFContents:
    """One file version's header, parsed once a process: `kiln launch`, the quality gate
    and the tests compile one file under several schemes."""
    return read(Path(path))


class GGUFFile:
    """Metadata and tensors of one GGUF file (compiler/gguf_read.py), memory-mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            st = path.stat()
            self._contents = _open(str(path.resolve()), st.st_size, st.st_mtime_ns)
        except (GGUFReadError, OSError) as e:
            raise CheckpointError(f"{path.name}: not a readable GGUF file ({e})") from None
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{path.name}: GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self.arch: str = arch

    def field(self, key: str, default: Any = None) -> Any:
        return self._contents.fields.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    @cached_property
    def tensors(self) -> dict[str, TensorRecord]:
        """Hugging Face name -> the file's tensor record."""
        out = {}
        for t in self._contents.tensors:
            if t.name in _ROPE_FACTORS or t.name == _FREQ_FACTORS:
                continue
            name = _hf_name(t.name, self.arch)
            if name is None:
                raise CheckpointError(f"{self.path.name}: unknown tensor {t.name!r}")
            out[name] = t
        return out

    # -- config ---------------------------------------------------------------------------
    def hf_config(self) -> dict[str, Any]:
        """The metadata as the fields of a transformers `config.json`."""
        tokens = self.field("tokenizer.ggml.tokens") or []
        heads = int(self.arch_field("attention.head_count"))
        hidden = int(self.arch_field("embedding_length"))
        cfg: dict[str, Any] = {
            "model_type": ARCHITECTURES[self.arch],
            "architectures": [_ARCH_CLASS[self.arch]],
            "vocab_size": int(self.arch_field("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": int(self.arch_field("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "hidden_act": _HIDDEN_ACT.get(self.arch, "silu"),
            "torch_dtype": "float32",
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        scaling = self.arch_field("rope.scaling.type")
        if scaling == "linear":
            factor = float(self.arch_field("rope.scaling.factor", 1.0))
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling == "yarn":
            cfg["rope_scaling"] = self._yarn()
        elif scaling not in (None, "none"):
            raise CheckpointError(f"{self.path.name}: rope scaling {scaling!r} is not supported")
        freq = next((t for t in self._contents.tensors if t.name == _FREQ_FACTORS), None)
        if freq is not None:
            if scaling not in (None, "none"):
                raise CheckpointError(
                    f"{self.path.name}: {_FREQ_FACTORS} beside rope scaling {scaling!r}"
                )
            factors = [float(x) for x in np.asarray(freq.data, dtype=np.float32).reshape(-1)]
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors}
        window = self.arch_field("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
            # Which layers slide, one flag a layer (EXAONE 4's files; llama.cpp assumes
            # every fourth layer global where an EXAONE file leaves it out).
            pattern = self.arch_field("attention.sliding_window_pattern")
            if isinstance(pattern, list):
                if len(pattern) != cfg["num_hidden_layers"]:
                    raise CheckpointError(
                        f"{self.path.name}: sliding_window_pattern has {len(pattern)} flags "
                        f"for {cfg['num_hidden_layers']} layers"
                    )
                kinds = ("full_attention", "sliding_attention")
                cfg["layer_types"] = [kinds[bool(f)] for f in pattern]
            elif pattern is not None:  # every pattern-th layer global
                cfg["sliding_window_pattern"] = int(pattern)
            elif self.arch in ("exaone4", "cohere2", "olmo2"):  # llama.cpp's default for them
                cfg["sliding_window_pattern"] = 4
            if self.arch == "olmo2":  # OLMo 3 (llama.cpp's olmo2 with sliding layers)
                cfg.update(self._olmo3())
        if self.arch in _NORMS_PLUS_ONE:  # Gemma 1, 2 and 3
            # What the file does not say, as llama.cpp assumes it: GELU-tanh, and a query
            # scale of head_dim (the 27B models' differs; llama.cpp special-cases them).
            cfg["hidden_activation"] = "gelu_pytorch_tanh"
        if self.arch in _SANDWICH:
            cfg["query_pre_attn_scalar"] = cfg["head_dim"]
            if cfg["num_hidden_layers"] in _GEMMA_27B_LAYERS[self.arch]:
                cfg["query_pre_attn_scalar"] = hidden // heads
        if self.arch in ("granite", "granitemoe"):
            cfg.update(self._granite(cfg["head_dim"]))
        if self.arch == "granitemoe":  # every layer's experts; their width the FFN length
            cfg["num_local_experts"] = int(self.arch_field("expert_count"))
            cfg["num_experts_per_tok"] = int(self.arch_field("expert_used_count"))
        if self.arch == "gemma3":
            # A global layer every sixth, the local rope base 10000 (llama.cpp's constants).
            cfg["sliding_window_pattern"] = 6
            cfg["rope_local_base_freq"] = 10000.0
        if self.arch == "phi3":
            cfg.update(self._phi3_rope())
        if self.arch == "gpt-oss":
            cfg.update(self._gpt_oss())
        if self.arch == "deepseek2":
            cfg.update(self._deepseek())
        if self.arch in _QWEN_MOES:
            cfg.update(self._qwen_moe(cfg["intermediate_size"]))
        if self.arch in _LAYER_NORM_ARCHS:  # a LayerNorm's epsilon, under its own key
            cfg["rms_norm_eps"] = float(self.arch_field("attention.layer_norm_epsilon", 1e-5))
        if self.arch in ("command-r", "cohere2"):
            cfg["logit_scale"] = float(self.arch_field("logit_scale", 0.0625))
        if self.arch == "starcoder2":  # biases everywhere (llama.cpp requires them)
            cfg["use_bias"] = True
        if self.arch in _PARTIAL_ROTARY:  # the rotary part of a head
            rotary = int(self.arch_field("rope.dimension_count", cfg["head_dim"]))
            cfg["partial_rotary_factor"] = rotary / cfg["head_dim"]
        biased = self._in_first_layer("self_attn.q_proj.bias")
        if self.arch in ("glm4", "nemotron"):  # q/k/v biases where stored
            cfg["attention_bias"] = biased
        # LayerNorms over each head of q and k where stored (StableLM 2 12B's, Command R+'s)
        head_norms = self._in_first_layer("self_attn.q_norm.weight")
        if self.arch == "command-r":
            cfg["use_qk_norm"] = head_norms
        if self.arch == "stablelm":  # side by side where the MLP has no norm of its own
            cfg["qk_layernorm"] = head_norms
            cfg["use_qkv_bias"] = biased
            cfg["use_parallel_residual"] = not self._in_first_layer(
                "post_attention_layernorm.weight"
            )
        if self.arch in ("nemotron", "arcee"):
            cfg["mlp_bias"] = self._in_first_layer("mlp.up_proj.bias")
        if self.arch == "gemma2":
            # Sliding and global layers alternate; the caps are in the file (llama.cpp's
            # converter writes them), else Gemma 2's published 50 and 30.
            cfg["attn_logit_softcapping"] = float(self.arch_field("attn_logit_softcapping", 50.0))
            cfg["final_logit_softcapping"] = float(self.arch_field("final_logit_softcapping", 30.0))
        return cfg

    def _olmo3(self) -> dict[str, Any]:
        """OLMo 3 from an olmo2 file with a sliding window: the global layers take the file's
        rope (and its scaling), the sliding ones plain rope of their own base or the same
        one, as llama.cpp runs them."""
        base = self.arch_field("rope.freq_base_swa", self.arch_field("rope.freq_base", 10000.0))
        sliding = {"rope_type": "default", "rope_theta": float(base)}
        return {"model_type": "olmo3", "rope_parameters": {"sliding_attention": sliding}}

    def _granite(self, head_dim: int) -> dict[str, Any]:
        """Granite's multipliers under llama.cpp's names; one the file leaves out means
        what llama.cpp then does: no scaling, and attention's scale 1 / sqrt(head_dim)."""
        return {
            "embedding_multiplier": float(self.arch_field("embedding_scale") or 1.0),
            "residual_multiplier": float(self.arch_field("residual_scale") or 1.0),
            "attention_multiplier": float(self.arch_field("attention.scale") or head_dim**-0.5),
            "logits_scaling": float(self.arch_field("logit_scale") or 1.0),
        }

    def _yarn(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(self.arch_field("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                self.arch_field("rope.scaling.original_context_length", 4096)
            ),
            "beta_fast": float(self.arch_field("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(self.arch_field("rope.scaling.yarn_beta_slow", 1.0)),
        }
        if self.arch == "gpt-oss":
            out["truncate"] = False  # as its own definition does (transformers' config)
        log_mul = self.arch_field("rope.scaling.yarn_log_multiplier")
        if self.arch == "deepseek2" and log_mul:
            # llama.cpp's converter writes 0.1 * mscale_all_dim here for DeepSeek.
            m_all = float(log_mul) / 0.1
            out.update(mscale=m_all, mscale_all_dim=m_all)
        return out

    def _gpt_oss(self) -> dict[str, Any]:
        """What llama.cpp's gpt-oss keys say; its SwiGLU alpha and limit are constants there."""
        return {
            "num_local_experts": int(self.arch_field("expert_count")),
            "num_experts_per_tok": int(self.arch_field("expert_used_count")),
            "intermediate_size": int(
                self.arch_field(
                    "expert_feed_forward_length", self.arch_field("feed_forward_length")
                )
            ),
            "sliding_window": int(self.arch_field("attention.sliding_window", 128)),
            "attention_bias": True,
            "swiglu_limit": 7.0,
        }

    def _deepseek(self) -> dict[str, Any]:
        """DeepSeek V2 / V3 from llama.cpp's deepseek2 keys: latent attention's widths (its
        key_length is the pooled one; the per-head ones are the _mla keys), the experts,
        and V3 by its sigmoid gating (expert_gating_func 2)."""
        rope = int(self.arch_field("rope.dimension_count"))
        latent = int(self.arch_field("attention.kv_lora_rank"))
        # V3 scores by sigmoid (expert_gating_func 2, written where the config names its
        # scoring_func) and has a correction bias (exp_probs_b); V2 neither.
        v3 = int(self.arch_field("expert_gating_func", 1)) == 2 or any(
            n.endswith("e_score_correction_bias") for n in self.tensors
        )
        groups = int(self.arch_field("expert_group_count", 0) or 0)
        out: dict[str, Any] = {
            "model_type": "deepseek_v3" if v3 else "deepseek_v2",
            "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
            "q_lora_rank": self.arch_field("attention.q_lora_rank"),
            "kv_lora_rank": latent,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": int(self.arch_field("attention.key_length_mla")) - rope,
            "v_head_dim": int(self.arch_field("attention.value_length_mla")),
            "head_dim": rope,
            "num_key_value_heads": int(self.arch_field("attention.head_count")),
            "n_routed_experts": int(self.arch_field("expert_count", 0)),
            "num_experts_per_tok": int(self.arch_field("expert_used_count", 1)),
            "moe_intermediate_size": int(self.arch_field("expert_feed_forward_length", 0)),
            "n_shared_experts": int(self.arch_field("expert_shared_count", 0)),
            "first_k_dense_replace": int(self.arch_field("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(self.arch_field("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(self.arch_field("expert_weights_norm", False)),
            "rope_interleave": True,  # llama.cpp turns DeepSeek's pairs as stored
        }
        if groups > 1:
            out.update(
                n_group=groups,
                topk_group=int(self.arch_field("expert_group_used_count", groups)),
                topk_method="noaux_tc" if v3 else "group_limited_greedy",
            )
        else:
            out.update(n_group=1, topk_group=1, topk_method="noaux_tc" if v3 else "greedy")
        return out

    def _in_first_layer(self, name: str) -> bool:
        """The file holds layer 0's tensor `name` (transformers' name within the layer):
        what llama.cpp decides an optional part by."""
        return f"model.layers.0.{name}" in self.tensors

    def _qwen_moe(self, ffn: int) -> dict[str, Any]:
        """Qwen2-MoE, Qwen3-MoE and OLMoE from llama.cpp's keys, with what its programs
        assume of them: every layer sparse, the top-k weights rescaled to sum to 1 for
        Qwen3-MoE only, Qwen2-MoE's shared expert as wide as the dense MLP where the file
        leaves its width out and its q/k/v biases where the file has them."""
        qwen2 = self.arch == "qwen2moe"
        out: dict[str, Any] = {
            "num_experts": int(self.arch_field("expert_count")),
            "num_experts_per_tok": int(self.arch_field("expert_used_count")),
            "moe_intermediate_size": int(self.arch_field("expert_feed_forward_length", ffn)),
            "norm_topk_prob": self.arch == "qwen3moe",
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        if qwen2:
            shared = self.arch_field("expert_shared_feed_forward_length") or ffn
            out["shared_expert_intermediate_size"] = int(shared)
            out["qkv_bias"] = self._in_first_layer("self_attn.q_proj.bias")
        return out

    def _phi3_rope(self) -> dict[str, Any]:
        """Phi-3's LongRoPE: the factor tensors and the pretraining context llama.cpp's
        converter writes."""
        out: dict[str, Any] = {}
        factors = {
            key: [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
            for t in self._contents.tensors
            if (key := _ROPE_FACTORS.get(t.name))
        }
        if factors:
            original = self.arch_field("rope.scaling.original_context_length")
            if original is None:
                raise CheckpointError(
                    f"{self.path.name}: LongRoPE factors without "
                    "phi3.rope.scaling.original_context_length"
                )
            scaling: dict[str, Any] = {"rope_type": "longrope", **factors}
            scaling["original_max_position_embeddings"] = int(original)
            attn = self.arch_field("rope.scaling.attn_factor")
            if attn is not None:
                scaling["attention_factor"] = float(attn)
            out["rope_scaling"] = scaling
        return out

    # -- tensors --------------------------------------------------------------------------
    @cached_property
    def derived(self) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
        """Tensors the model definitions read that llama.cpp stores in another form:
        Hugging Face name -> (shape, how to make it from the stored ones)."""
        out: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
        for i in range(int(self.arch_field("block_count", 0))):
            layer = f"model.layers.{i}"
            stacked = f"{layer}.mlp.experts.gate_exps" + (
                ".weight" if self.arch == "gpt-oss" else ""
            )
            if self.arch == "gpt-oss" and stacked in self.tensors:
                out.update(self._gpt_oss_experts(layer))
            if self.arch in ("deepseek2", *_QWEN_MOES) and stacked in self.tensors:
                out.update(self._routed_experts(layer))
            gate = f"{layer}.mlp.shared_expert_gate.vector"
            if gate in self.tensors:
                # [hidden] or [1, hidden] in the file, as converters write it
                out[gate.replace(".vector", ".weight")] = self._one_row(gate)
            if self.arch == "deepseek2" and f"{layer}.self_attn.k_b_proj.weight" in self.tensors:
                out.update(self._kv_b(layer))
            if self.arch == "stablelm":
                out.update(self._per_head_norms(layer))
            if self.arch == "granitemoe" and f"{layer}.block_sparse_moe.gate_exps" in self.tensors:
                out.update(self._granite_experts(layer))
        return out

    def _granite_experts(self, layer: str) -> dict[str, Any]:
        """Granite MoE's input_linear [experts, 2 * width, hidden] (each expert's gate rows,
        then its up rows) and output_linear from the stacked tensors llama.cpp stores."""
        p = f"{layer}.block_sparse_moe."
        e, width, hidden = self._stored_shape(p + "gate_exps")

        def gate_up() -> np.ndarray:
            return np.concatenate((self.get(p + "gate_exps"), self.get(p + "up_exps")), axis=1)

        return {
            p + "input_linear.weight": ((e, 2 * width, hidden), gate_up),
            p + "output_linear.weight": ((e, hidden, width), lambda: self.get(p + "down_exps")),
        }

    def _per_head_norms(self, layer: str) -> dict[str, Any]:
        """StableLM's one LayerNorm a head (`q_layernorm.norms.<h>.weight`) from the
        [heads, dim] tensor llama.cpp's converter stacks them into; k's alike."""
        out: dict[str, Any] = {}
        for which in ("q", "k"):
            stacked = f"{layer}.self_attn.{which}_norm.weight"
            if stacked not in self.tensors:
                continue
            heads, dim = self._stored_shape(stacked)
            for h in range(heads):
                name = f"{layer}.self_attn.{which}_layernorm.norms.{h}.weight"
                out[name] = ((dim,), lambda s=stacked, h=h: self.get(s)[h])
        return out

    def _gpt_oss_experts(self, layer: str) -> dict[str, Any]:
        """transformers' stacked GPT-OSS experts: gate_up_proj [experts, hidden, 2 * width]
        with gate and up interleaved by column, its bias alike, down_proj [experts, width,
        hidden]."""
        p = f"{layer}.mlp.experts."

        def interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
            out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=np.float32)
            out[..., 0::2], out[..., 1::2] = gate, up
            return out

        e, width, hidden = self._stored_shape(p + "gate_exps.weight")
        return {
            p + "gate_up_proj": (
                (e, hidden, 2 * width),
                lambda: interleaved(
                    self.get(p + "gate_exps.weight").transpose(0, 2, 1),
                    self.get(p + "up_exps.weight").transpose(0, 2, 1),
                ),
            ),
            p + "gate_up_proj_bias": (
                (e, 2 * width),
                lambda: interleaved(self.get(p + "gate_exps.bias"), self.get(p + "up_exps.bias")),
            ),
            p + "down_proj": (
                (e, width, hidden),
                lambda: np.ascontiguousarray(self.get(p + "down_exps.weight").transpose(0, 2, 1)),
            ),
            p + "down_proj_bias": ((e, hidden), lambda: self.get(p + "down_exps.bias")),
        }

    def _one_row(self, name: str) -> tuple[tuple[int, ...], Callable[[], np.ndarray]]:
        return (1, self._stored_shape(name)[-1]), lambda: self.get(name).reshape(1, -1)

    def _routed_experts(self, layer: str) -> dict[str, Any]:
        """Each routed expert's own gate, up and down, cut from the stacked tensors."""
        out: dict[str, Any] = {}
        for part in ("gate", "up", "down"):
            stacked = f"{layer}.mlp.experts.{part}_exps"
            e, *shape = self._stored_shape(stacked)
            for i in range(e):
                out[f"{layer}.mlp.experts.{i}.{part}_proj.weight"] = (
                    tuple(shape),
                    lambda s=stacked, i=i: self._expert(s, i),
                )
        return out

    def _expert(self, stacked: str, i: int) -> np.ndarray:
        """Expert i of a stacked [experts, rows, cols] tensor: only its own blocks
        dequantized (not the whole stack once per expert)."""
        from gguf.quants import dequantize

        t = self._record(stacked)
        e, rows, cols = self._stored_shape(stacked)
        part = np.asarray(t.data).reshape(e, -1)[i].reshape(rows, -1)
        return dequantize(part, t.tensor_type).reshape(rows, cols).astype(np.float32, copy=False)

    def _kv_b(self, layer: str) -> dict[str, Any]:
        """kv_b_proj [heads * (nope + v), latent] from its halves as llama.cpp stores them."""
        k_b, v_b = f"{layer}.self_attn.k_b_proj.weight", f"{layer}.self_attn.v_b_proj.weight"
        heads, latent, nope = self._stored_shape(k_b)
        v = self._stored_shape(v_b)[1]

        def make() -> np.ndarray:
            halves = (self.get(k_b).transpose(0, 2, 1), self.get(v_b))
            return np.concatenate(halves, axis=1).reshape(heads * (nope + v), latent)

        return {f"{layer}.self_attn.kv_b_proj.weight": ((heads * (nope + v), latent), make)}

    def has(self, name: str) -> bool:
        return name in self.tensors or name in self.derived

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.derived:
            return self.derived[name][0]
        return self._stored_shape(name)

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        t = self._record(name)
        return tuple(reversed(t.shape))

    def qtype(self, name: str) -> str:
        if name in self.derived:
            return "F32"  # made from dequantized tensors
        return str(self._record(name).tensor_type.name)

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 in transformers' layout (dequantized, q/k rows restored)."""
        from gguf.quants import dequantize

        if name in self.derived:
            return self.derived[name][1]()
        t = self._record(name)
        shape = self.shape(name)
        data = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32, copy=False)
        if self.arch in _STORED_PLUS_ONE and name.endswith("norm.weight"):
            data = data - 1.0
        return self._unpermute(name, data)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's blocks as stored (uint8 rows for block formats), q/k rows restored."""
        t = self._record(name)
        return self._unpermute(name, np.asarray(t.data))

    def _record(self, name: str) -> TensorRecord:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path.name} has no tensor for {name!r}")
        return t

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        if self.arch not in _PERMUTED_QK:
            return rows
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            heads = int(self.arch_field("attention.head_count"))
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            heads = int(self.arch_field("attention.head_count_kv"))
        else:
            return rows
        # Each head's rows were stored as (pairs, 2) -> undo to (2, pairs): a pure row
        # permutation, so it applies to quantized blocks (which run along a row) as well.
        n = rows.shape[0]
        rest = rows.shape[1:]
        restored = rows.reshape(heads, n // heads // 2, 2, *rest).swapaxes(1, 2)
        return np.ascontiguousarray(restored.reshape(n, *rest))

    # -- tokenizer ------------------------------------------------------------------------
    def write_tokenizer(self, dst: Path) -> None:
        """tokenizer.json + tokenizer_config.json for a byte-level BPE vocabulary (written
        here) or a SentencePiece one (converted by transformers' own GGUF reader)."""
        model = self.field("tokenizer.ggml.model")
        if model == "llama":
            self._write_sentencepiece_tokenizer(dst)
            return
        if model != "gpt2":
            raise CheckpointError(
                f"{self.path.name}: tokenizer model {model!r} is not supported yet (kiln reads "
                "byte-level BPE vocabularies, tokenizer.ggml.model = gpt2); pass the "
                "original model's tokenizer folder with --tokenizer-path"
            )
        tokens: list[str] = list(self.field("tokenizer.ggml.tokens"))
        types: list[int] = list(self.field("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges: list[str] = list(self.field("tokenizer.ggml.merges") or [])
        pre = self.field("tokenizer.ggml.pre", "default")
        bos = self.field("tokenizer.ggml.bos_token_id")
        eos = self.field("tokenizer.ggml.eos_token_id")
        add_bos = bool(self.field("tokenizer.ggml.add_bos_token", False))

        added = [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": types[i] != _CONTROL,
                "special": types[i] == _CONTROL,
            }
            for i, tok in enumerate(tokens)
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
        if pre in _SPLIT_PATTERNS:
            pre_tokenizer: dict[str, Any] = {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": _SPLIT_PATTERNS[pre]},
                        "behavior": "Isolated",
                        "invert": False,
                    },
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": True,
                        "use_regex": False,
                    },
                ],
            }
        elif pre in _GPT2_PRE or pre in _DIGITS_THEN_GPT2:
            pre_tokenizer = {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            }
            if pre in _DIGITS_THEN_GPT2:
                digits = {"type": "Digits", "individual_digits": True}
                pre_tokenizer = {"type": "Sequence", "pretokenizers": [digits, pre_tokenizer]}
        else:
            raise CheckpointError(
                f"{self.path.name}: pre-tokenizer {pre!r} is not supported yet (supported: "
                f"{', '.join(sorted({*_GPT2_PRE, *_SPLIT_PATTERNS, *_DIGITS_THEN_GPT2}))}); "
                "pass the original model's tokenizer folder with --tokenizer-path"
            )
        post: dict[str, Any] | None = None
        if add_bos and bos is not None:
            bos_tok = tokens[bos]
            post = {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": bos_tok, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "pair": [
                    {"SpecialToken": {"id": bos_tok, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {bos_tok: {"id": bos_tok, "ids": [bos], "tokens": [bos_tok]}},
            }
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": pre in _IGNORE_MERGES,
                "vocab": {tok: i for i, tok in enumerate(tokens)},
                "merges": [m.split(" ", 1) for m in merges],
            },
        }
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": add_bos,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(self.arch_field("context_length", 2048)),
        }
        for key, tid in (("bos_token", bos), ("eos_token", eos)):
            if tid is not None:
                config[key] = tokens[tid]
        pad = self.field("tokenizer.ggml.padding_token_id")
        if pad is not None:
            config["pad_token"] = tokens[pad]
        template = self.field("tokenizer.chat_template")
        if template:
            config["chat_template"] = template
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    def _write_sentencepiece_tokenizer(self, dst: Path) -> None:
        """A SentencePiece vocabulary with scores (tokenizer.ggml.model = llama: Gemma,
        Llama 2) as transformers converts it: its byte-fallback BPE, special tokens and
        normaliser are what transformers, the oracle, tokenizes with. Naming the tokenizer
        type spares AutoTokenizer building the model's config from the file, which reads
        its whole header with the gguf package (Gemma 3: 26 s -> 4 s on a Zen 3 core, the
        same files written)."""
        from transformers import AutoTokenizer
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

        model_type = ARCHITECTURES[self.arch]
        typed = {"tokenizer_type": model_type} if TOKENIZER_MAPPING_NAMES.get(model_type) else {}
        try:
            tok = AutoTokenizer.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, **typed
            )
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(
                f"{self.path.name}: its SentencePiece vocabulary does not convert ({e}); pass "
                "the original model's tokenizer folder with --tokenizer-path"
            ) from None
        dst.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(dst))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (dst / name).is_file():
                raise CheckpointError(f"{self.path.name}: transformers wrote no {name}")


_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "command-r": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "arcee": "ArceeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi2": "PhiForCausalLM",
}


def _hf_name(gguf_name: str, arch: str) -> str | None:
    top = _PHI2_GLOBAL if arch == "phi2" else _GLOBAL
    if gguf_name in top:
        return top[gguf_name]
    layer = _LAYERS.get(arch, _LAYER)
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in layer:
        return None
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
