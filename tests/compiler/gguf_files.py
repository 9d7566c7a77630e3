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
    "lm_head.weight": "output.weight",
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
}


# Gemma's sandwich norms, as llama.cpp names them.
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3's fused tensors.
_PHI3_LAYER = {
    **_LAYER,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# model_type -> GGUF architecture where they differ.
_ARCH = {"gemma3_text": "gemma3"}


def gguf_name(hf: str, gemma: bool = False) -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    parts = hf.split(".")
    layer = _GEMMA_LAYER if gemma else _PHI3_LAYER
    return f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}"


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter: per head, rows (2, pairs) -> (pairs, 2).
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: Path, out: Path, qtype: str = "F32", *, pre: str = "gpt2") -> Path:
    """`ckpt`'s weights with every 2-D matrix stored as `qtype`, norms and biases F32."""
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
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
    w.add_rope_freq_base(float(theta))
    params = cfg.get("rope_parameters") or {}
    w.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 1.0)))
    if params.get("rope_type") == "longrope":  # as llama.cpp's converter writes LongRoPE
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for kind in ("short", "long"):
            factors = np.asarray(params[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])

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

    qt = GGMLQuantizationType[qtype]
    for name, t in load_file(str(ckpt / "model.safetensors")).items():
        t = t.astype(np.float32)
        if arch in ("llama", "mistral") and ("q_proj" in name or "k_proj" in name):
            t = _interleave(t, heads if "q_proj" in name else kv_heads)
        if gemma and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if t.ndim == 2 and qt != GGMLQuantizationType.F32:
            data = quantize(t, qt)
            w.add_tensor(gguf_name(name, gemma), data, raw_shape=data.shape, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name, gemma), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
