"""Write a GGUF file from a tiny Hugging Face checkpoint, as llama.cpp's converter lays it out
(names, metadata keys, q/k rows interleaved for llama), with chosen tensor types. The tests
read it back with kiln and with transformers' own GGUF loader (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.norm.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    # Phi-2's final norm and lm_head bias
    "model.final_layernorm.weight": "output_norm.weight",
    "model.final_layernorm.bias": "output_norm.bias",
    "lm_head.bias": "output.bias",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    # StarCoder 2's LayerNorm biases, o_proj's bias and plain MLP
    "input_layernorm.bias": "attn_norm.bias",
    "post_attention_layernorm.bias": "ffn_norm.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    **{f"mlp.c_fc.{k}": f"ffn_up.{k}" for k in ("weight", "bias")},
    **{f"mlp.c_proj.{k}": f"ffn_down.{k}" for k in ("weight", "bias")},
    # Phi-2's
    **{f"self_attn.dense.{k}": f"attn_output.{k}" for k in ("weight", "bias")},
    **{f"mlp.fc1.{k}": f"ffn_up.{k}" for k in ("weight", "bias")},
    **{f"mlp.fc2.{k}": f"ffn_down.{k}" for k in ("weight", "bias")},
}


# Gemma's sandwich norms, as llama.cpp names them.
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# OLMo 2's norms after attention and after the MLP.
_OLMO2_LAYER = {
    **_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_POST_NORMS = ("olmo2", "exaone4")  # OLMo 3's files are olmo2's
# GLM-4's four norms and fused gate/up.
_GLM4_LAYER = {
    **_LAYER,
    "post_self_attn_layernorm.weight": "post_attention_norm.weight",
    "post_mlp_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# Phi-3's fused tensors.
_PHI3_LAYER = {
    **_LAYER,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# model_type -> GGUF architecture where they differ.
_ARCH = {
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt-oss",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "cohere": "command-r",
    "olmo3": "olmo2",  # llama.cpp's olmo2, with a sliding window
    "phi": "phi2",
}


# llama.cpp's LlamaModel converter and those built on it interleave q/k rows.
_PERMUTED = ("llama", "mistral", "granite", "smollm3", "arcee")

# Block types the gguf package decodes but cannot make: written as random blocks (codes
# and sub-block scales at random, the float16 scales small enough for a sane model).
_RANDOM_BLOCKS = {
    "Q4_K": ((0, 2), 1e-3),
    "Q5_K": ((0, 2), 5e-4),
    "Q6_K": ((208,), 1e-4),
    "Q5_0": ((0,), 1e-2),
    "Q5_1": ((0, 2), 1e-2),
    "Q2_K": ((80, 82), 1e-3),
    "Q3_K": ((108,), 1e-4),
    "IQ4_NL": ((0,), 1e-3),
    "IQ4_XS": ((0,), 5e-5),
}


def random_blocks(shape: tuple[int, ...], qtype: str, seed: int) -> np.ndarray:
    """uint8 [rows, bytes] of valid `qtype` blocks for a [rows, k] tensor."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    qt = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[qt]
    rows, k = shape
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    offsets, scale = _RANDOM_BLOCKS[qtype]
    for at in offsets:  # each a float16 scale (Q4_K: d and dmin)
        d = rng.uniform(0.2, 1.0, (rows, k // block)) * scale
        raw[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def gguf_name(hf: str, gemma: bool = False, arch: str = "") -> str:
    """`gemma`: Gemma 2's and 3's sandwich norms' names."""
    if hf in _NAMES:
        return _NAMES[hf]
    parts = hf.split(".")
    layer = (
        _GEMMA_LAYER
        if gemma
        else _OLMO2_LAYER
        if arch in _POST_NORMS
        else _GLM4_LAYER
        if arch == "glm4"
        else _PHI3_LAYER
    )
    return f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}"


def _llama3_divisors(params: dict, head_dim: int, theta: float) -> np.ndarray:
    """Llama 3.1's rope scaling as the divisor of each pair's frequency: 1 for wavelengths
    under the pretraining context / high_freq_factor, `factor` above the context /
    low_freq_factor, and between them the inverse of the blend (1 - s) / factor + s."""
    import math

    ctx = params["original_max_position_embeddings"]
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            s = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, dtype=np.float32)


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter: per head, rows (2, pairs) -> (pairs, 2).
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    ckpt: Path,
    out: Path,
    qtype: str = "F32",
    *,
    pre: str = "gpt2",
    overrides: dict[str, str] | None = None,
) -> Path:
    """`ckpt`'s weights with every 2-D matrix stored as `qtype` (or as overrides[part] for a
    name containing `part`, llama.cpp's mixes), norms and biases F32."""
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    arch = _ARCH.get(cfg["model_type"], cfg["model_type"])
    gemma = arch in ("gemma2", "gemma3")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    if arch != "deepseek2":  # its own: latent attention's widths (_write_moe_family)
        w.add_head_count_kv(kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    ln_eps = next(
        (cfg[k] for k in ("norm_epsilon", "layer_norm_eps", "norm_eps") if k in cfg), None
    )
    if ln_eps is not None:  # a LayerNorm's (StarCoder 2, Cohere, StableLM, Nemotron)
        w.add_layer_norm_eps(ln_eps)
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # one rope a layer type (OLMo 3)
    theta = cfg.get("rope_theta") or params.get("rope_theta", 1e4)
    w.add_rope_freq_base(float(theta))
    w.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 1.0)))
    if params.get("rope_type") == "llama3":  # llama.cpp's converter: a divisor per pair
        w.add_tensor("rope_freqs.weight", _llama3_divisors(params, head_dim, float(theta)))
    if params.get("rope_type") == "longrope":  # as llama.cpp's converter writes LongRoPE
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for kind in ("short", "long"):
            factors = np.asarray(params[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
        if arch in ("exaone4", "olmo2"):  # llama.cpp's converter: a flag a layer
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("command-r", "cohere2"):
        w.add_logit_scale(cfg["logit_scale"])
    if arch in ("granite", "granitemoe"):  # llama.cpp's converter: the multipliers
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])

    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for a in tok["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if arch == "phi3":  # else transformers' loader takes Phi-3's 32000, past this vocabulary
        w.add_pad_token_id(0)
    w.add_add_bos_token(tok.get("post_processor") is not None)
    jinja = ckpt / "chat_template.jinja"
    template = jinja.read_text() if jinja.is_file() else tok_cfg.get("chat_template")
    if template:
        w.add_chat_template(template)

    tensors = load_file(str(ckpt / "model.safetensors"))
    if arch in _MOE_ARCHS:
        _write_moe_family(w, cfg, arch, tensors, GGMLQuantizationType[qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out
    if arch == "stablelm":  # llama.cpp's converter: a layer's per-head norms stacked
        tensors = _stacked_head_norms(tensors)
    for name, t in tensors.items():
        kind = next((q for part, q in (overrides or {}).items() if part in name), qtype)
        if "norm" in name:  # norms stay F32 (Cohere's per-head ones are [heads, dim])
            kind = "F32"
        qt = GGMLQuantizationType[kind]
        t = t.astype(np.float32)
        if arch in _PERMUTED and ("q_proj" in name or "k_proj" in name):
            t = _interleave(t, heads if "q_proj" in name else kv_heads)
        if (gemma or arch in ("gemma", "nemotron")) and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's norms (and Nemotron's) as 1 + w
        if t.ndim == 2 and kind in _RANDOM_BLOCKS:
            data = random_blocks(t.shape, kind, seed=len(name) * 7919 + t.shape[0])
            w.add_tensor(gguf_name(name, gemma, arch), data, raw_shape=data.shape, raw_dtype=qt)
        elif t.ndim == 2 and qt != GGMLQuantizationType.F32:
            data = quantize(t, qt)
            w.add_tensor(gguf_name(name, gemma, arch), data, raw_shape=data.shape, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name, gemma, arch), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_MOE_ARCHS = ("gpt-oss", "deepseek2", "qwen2moe", "qwen3moe", "olmoe", "granitemoe")


def _stacked_head_norms(tensors: dict) -> dict:
    """StableLM's `q_layernorm.norms.<h>.weight` (one a head) as one [heads, dim]
    `q_norm.weight` a layer, k's alike, as llama.cpp's converter stacks them."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        if ".norms." not in name:
            out[name] = t
            continue
        module, rest = name.split(".norms.")
        stacks.setdefault(module, {})[int(rest.split(".")[0])] = t
    for module, heads in stacks.items():
        layer, part = module.rsplit(".", 1)
        out[f"{layer}.{part[0]}_norm.weight"] = np.stack([heads[h] for h in sorted(heads)])
    return out


def _write_moe_family(w: GGUFWriter, cfg: dict, arch: str, tensors: dict, qt: object) -> None:
    """GPT-OSS, DeepSeek V2 / V3, Qwen2-MoE and Qwen3-MoE as llama.cpp's converter writes
    them: its keys, its tensor names (the gguf package's own map), experts stacked with gate
    and up apart, DeepSeek's kv_b as its absorbed halves; routers and Qwen2-MoE's shared
    expert gate kept F32, as llama.cpp's quantizer keeps them."""
    import gguf

    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(
        {
            "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
            "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
            "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
            "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
            "olmoe": gguf.MODEL_ARCH.OLMOE,
            "granitemoe": gguf.MODEL_ARCH.GRANITE_MOE,
        }[arch],
        layers,
    )
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    out: dict[str, np.ndarray] = {}
    if arch == "gpt-oss":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        for name, t in tensors.items():
            if name.endswith("experts.gate_up_proj"):
                base = name.removesuffix("gate_up_proj")
                t = t.transpose(0, 2, 1)  # [experts, 2 * width, hidden]
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = t[:, ::2], t[:, 1::2]
            elif name.endswith("experts.gate_up_proj_bias"):
                base = name.removesuffix("gate_up_proj_bias")
                out[base + "gate_proj.bias"], out[base + "up_proj.bias"] = t[:, ::2], t[:, 1::2]
            elif name.endswith("experts.down_proj"):
                out[name + ".weight"] = t.transpose(0, 2, 1)
            elif name.endswith("experts.down_proj_bias"):
                out[name.replace("down_proj_bias", "down_proj.bias")] = t
            elif name.endswith("sinks"):
                out[name + ".weight"] = t
            else:
                out[name] = t
    elif arch == "granitemoe":  # input_linear split into gate and up; q/k interleaved
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for name, t in tensors.items():
            if name.endswith("input_linear.weight"):
                base = name.removesuffix("block_sparse_moe.input_linear.weight")
                gate, up = np.split(t, 2, axis=1)
                out[base + "mlp.experts.gate_proj.weight"] = gate
                out[base + "mlp.experts.up_proj.weight"] = up
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                out[name] = _interleave(t, heads if "q_proj" in name else kv_heads)
            else:
                out[name] = t
    elif arch in ("qwen2moe", "qwen3moe", "olmoe"):
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size", cfg["intermediate_size"]))
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        out = _stacked_experts(tensors)
    else:
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        latent, heads = cfg["kv_lora_rank"], cfg["num_attention_heads"]
        w.add_head_count_kv(1)  # llama.cpp runs MLA as one KV head
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(latent)
        w.add_key_length(latent + rope)
        w.add_value_length(latent)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg["model_type"] == "deepseek_v3" and cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        for name, t in _stacked_experts(tensors).items():
            if name.endswith("kv_b_proj.weight"):
                kv_b = t.reshape(heads, nope + v, latent)
                out[name.replace("kv_b", "k_b")] = kv_b[:, :nope].transpose(0, 2, 1)
                out[name.replace("kv_b", "v_b")] = kv_b[:, nope:]
            elif name.endswith("e_score_correction_bias"):
                out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = t
            else:
                out[name] = t
    for name, t in out.items():
        t = np.ascontiguousarray(t.astype(np.float32))
        base, suffix = name.rsplit(".", 1) if name.endswith((".weight", ".bias")) else (name, "")
        mapped = names.get_name(base)
        assert mapped is not None, name
        gname = f"{mapped}.{suffix}" if suffix else mapped
        kept = "gate_inp" in gname  # routers, the shared expert's gate
        if t.ndim >= 2 and qt != GGMLQuantizationType.F32 and t.shape[-1] % 32 == 0 and not kept:
            data = quantize(t, qt)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qt)
        else:
            w.add_tensor(gname, t)


def _stacked_experts(tensors: dict) -> dict[str, np.ndarray]:
    """`tensors` with each layer's routed experts stacked, one tensor a part (as
    ...mlp.experts.gate_proj.weight [experts, out, in]); the rest as they are."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            key = ".".join([*parts[:5], parts[6], "weight"])  # ...mlp.experts.gate_proj.weight
            experts.setdefault(key, []).append((int(parts[5]), t))
        else:
            out[name] = t
    for key, rows in experts.items():
        out[key] = np.stack([t for _, t in sorted(rows, key=lambda r: r[0])])
    return out
