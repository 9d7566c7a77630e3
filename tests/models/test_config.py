from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.models import ModelConfig, ModelConfigError
from kiln.models.config import RopeConfig
from kiln.models.rope import inv_freq

# The published Llama-3.2-1B shape in the older (transformers 4) form.
LLAMA32 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008],
}


def test_old_and_new_rope_forms_read_the_same(tmp_path) -> None:
    new = dict(LLAMA32)
    new["rope_parameters"] = {**new.pop("rope_scaling"), "rope_theta": new.pop("rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps(new))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_dict(LLAMA32)
    cfg = ModelConfig.from_dict(LLAMA32)
    assert cfg.rope == RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_ids == (128001, 128008)
    assert cfg.head_dim == 64 and cfg.tie_word_embeddings


def test_llama3_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(**{k: v for k, v in LLAMA32.items() if k != "architectures"})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = inv_freq(ModelConfig.from_dict(LLAMA32).rope, 64)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_qwen3_head_dim_is_not_hidden_over_heads() -> None:
    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen3",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 10,
        }
    )
    assert cfg.head_dim == 128 and cfg.q_size == 2048 and cfg.qk_norm and not cfg.qkv_bias


def test_sliding_windows_per_family() -> None:
    base = {
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 10,
        "sliding_window": 4,
    }
    assert ModelConfig.from_dict({**base, "model_type": "mistral"}).sliding_windows == (4, 4)
    qwen2 = {**base, "model_type": "qwen2", "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen2).sliding_windows == (None, None)
    mixed = {**base, "model_type": "qwen2", "layer_types": ["sliding_attention", "full_attention"]}
    assert ModelConfig.from_dict(mixed).sliding_windows == (4, None)


# The latent attention fields a DeepSeek config cannot go without.
_MLA = {
    "model_type": "deepseek_v2",
    "kv_lora_rank": 4,
    "qk_nope_head_dim": 2,
    "qk_rope_head_dim": 2,
    "v_head_dim": 2,
}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic"}}, "rope type 'dynamic'"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}, "longrope needs"),
        (
            {
                "model_type": "phi3",
                "original_max_position_embeddings": 8,
                "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
            },
            "1 short and 1 long factors for 2 rotary pairs",
        ),
        ({"model_type": "phi3", "partial_rotary_factor": 0.3}, "partial_rotary_factor 0.3"),
        (
            {
                "model_type": "phi3",
                "original_max_position_embeddings": 8,
                "rope_scaling": {"type": "longrope"},
            },
            "longrope needs short_factor and long_factor",
        ),
        ({**_MLA, "attention_bias": True}, "attention_bias=true is not supported for DeepSeek"),
        ({**_MLA, "topk_method": "sqrt"}, "topk_method 'sqrt' is not supported"),
        # a clamp on q/k/v, a gated MLP's biases: named, not run
        ({"model_type": "olmoe", "clip_qkv": 8.0}, "olmoe with clip_qkv is not supported"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias=true is not supported"),
    ],
)
def test_unsupported_configs_say_why(bad, message) -> None:
    cfg = {
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 10,
        **bad,
    }
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(cfg)


def test_missing_config_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)


SHARED = Path(__file__).resolve().parents[3] / "shared" / "model-configs"


def test_moe_configs_read_as_each_family_means_them() -> None:
    """The published Mixtral-8x7B and Qwen3-30B-A3B shapes, and Qwen3-MoE's other
    spellings: transformers >= 5 writes num_local_experts; mlp_only_layers and
    decoder_sparse_step leave some layers dense."""
    mixtral = ModelConfig.from_hf(SHARED / "mixtral-8x7b.json")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == 14336 and mixtral.norm_topk_prob
    assert mixtral.sparse_layers == (True,) * 32
    qwen = ModelConfig.from_hf(SHARED / "qwen3-30b-a3b.json")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.norm_topk_prob and all(qwen.sparse_layers) and len(qwen.sparse_layers) == 48
    raw = json.loads((SHARED / "qwen3-30b-a3b.json").read_text())
    del raw["num_experts"]
    mixed = {**raw, "num_local_experts": 16, "mlp_only_layers": [0], "decoder_sparse_step": 2}
    m = ModelConfig.from_dict(mixed)
    assert m.num_experts == 16
    assert m.sparse_layers[:6] == (False, True, False, True, False, True)
    assert ModelConfig.from_manifest(m.to_dict()) == m
    assert ModelConfig.from_dict(LLAMA32).sparse_layers == ()


# The published Gemma 3 270M text config, in its first (transformers 4) form: one rope
# theta per attention kind as rope_theta / rope_local_base_freq, layer kinds from
# sliding_window_pattern, tie_word_embeddings left to the class default (true).
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}


def test_gemma3_reads_as_transformers_reads_it() -> None:
    from transformers import Gemma3TextConfig

    cfg = ModelConfig.from_dict(GEMMA3_270M)
    hf = Gemma3TextConfig(**{k: v for k, v in GEMMA3_270M.items() if k != "architectures"})
    windows = tuple(512 if t == "sliding_attention" else None for t in hf.layer_types)
    assert cfg.sliding_windows == windows and windows.count(None) == 3
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_tanh" and cfg.qk_norm
    assert cfg.rope.theta == 1e6 and cfg.local_rope == RopeConfig(10000.0)
    assert cfg.layer_rope(0) is cfg.local_rope and cfg.layer_rope(5) is cfg.rope
    assert cfg.attention_scale == 256**-0.5 and cfg.embed_scale == 640**0.5
    assert cfg.norm_offset == 1.0 and cfg.sandwich_norms
    # The transformers 5 form of the same config reads the same.
    new = {**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    new["bos_token_id"] = new["eos_token_id"] = None  # the class fills in defaults
    assert ModelConfig.from_dict(new) == cfg
    capped = ModelConfig.from_dict({**GEMMA3_270M, "final_logit_softcapping": 30.0})
    assert capped.final_softcap == 30.0 and cfg.final_softcap == cfg.attn_softcap == 0.0
    # What kiln does not run yet is named.
    with pytest.raises(ModelConfigError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**GEMMA3_270M, "use_bidirectional_attention": True})


@pytest.mark.parametrize(
    "params",
    [
        # Qwen2.5's long-context form
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        # DeepSeek's: the attention factor from mscale / mscale_all_dim
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ],
)
def test_yarn_frequencies_and_attention_factor_match_transformers(params) -> None:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen2Config(
        hidden_size=256,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=10,
        max_position_embeddings=131072,
        rope_parameters={**params, "rope_theta": 1e6},
    )
    ref, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_dict(hf.to_dict())
    torch.testing.assert_close(inv_freq(cfg.rope, 64), ref.float(), rtol=1e-6, atol=0)
    assert cfg.rope.attention_factor == pytest.approx(attention_factor) and attention_factor > 1


def test_gemma2_reads_as_transformers_reads_it() -> None:
    from transformers import Gemma2Config

    published = {  # Gemma 2 2B's config, in its first form (no layer_types)
        "model_type": "gemma2",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
    }
    cfg = ModelConfig.from_dict(published)
    hf = Gemma2Config(**{k: v for k, v in published.items() if k != "model_type"})
    assert cfg.sliding_windows == tuple(
        4096 if t == "sliding_attention" else None for t in hf.layer_types
    )
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert not cfg.qk_norm and cfg.local_rope is None and cfg.tie_word_embeddings


def _phi(**kw: object) -> dict:
    pairs = int(kw.pop("pairs", 48))  # type: ignore[call-overload]
    return {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 200064,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.0 + 0.5 * i for i in range(pairs)],
        },
        **kw,
    }


@pytest.mark.parametrize(
    "published",
    [
        _phi(),  # Phi-3.5-mini's shape: LongRoPE over whole heads of 96
        _phi(partial_rotary_factor=0.75, pairs=36, tie_word_embeddings=True),  # Phi-4-mini's
    ],
)
def test_phi3_longrope_reads_as_transformers_reads_it(published) -> None:
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig.from_dict(published)
    hf = Phi3Config(**{k: v for k, v in published.items() if k != "model_type"})
    assert cfg.fused_qkv and cfg.fused_gate_up and cfg.rope.rope_type == "longrope"
    assert cfg.rotary == int(96 * published.get("partial_rotary_factor", 1.0))
    for long, seq_len in ((False, None), (True, 4097)):
        ref, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        got = inv_freq(cfg.rope, cfg.rotary, cfg.head_dim, long=long)
        torch.testing.assert_close(got[: cfg.rotary // 2], ref.float(), rtol=1e-6, atol=0)
        assert not got[cfg.rotary // 2 :].any()  # the passed-through pairs do not turn
        assert cfg.rope.attention_factor == pytest.approx(factor) and factor > 1


def test_gpt_oss_reads_as_transformers_reads_it() -> None:
    from transformers import GptOssConfig

    published = {  # gpt-oss-20b's config.json, less what kiln does not read
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "num_local_experts": 32,
        "experts_per_token": 4,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    cfg = ModelConfig.from_dict(published)
    hf = GptOssConfig(**{k: v for k, v in published.items() if k != "model_type"})
    assert cfg.sliding_windows == tuple(
        128 if t == "sliding_attention" else None for t in hf.layer_types
    )
    assert cfg.sliding_windows[:2] == (128, None)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks and cfg.router_bias
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate


def test_deepseek_v3_reads_as_transformers_reads_it() -> None:
    from transformers import DeepseekV3Config

    published = {  # DeepSeek-V3's config.json, less what kiln does not read
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    }
    cfg = ModelConfig.from_dict(published)
    hf = DeepseekV3Config(**{k: v for k, v in published.items() if k != "model_type"})
    assert cfg.sparse_layers == tuple(i >= 3 for i in range(61))
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (256, 8, 4, 1)
    assert cfg.moe_scoring == "sigmoid" and cfg.score_correction_bias and cfg.norm_topk_prob
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.head_dim) == (512, 64, 64)
    # The softmax scale: transformers' attention's (yarn's mscale squared folded in).
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert cfg.mla_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192**-0.5))
    assert cfg.mla_scale > 192**-0.5


def test_every_family_and_gguf_architecture_is_in_the_models_doc() -> None:
    """docs/models.md lists what kiln reads: a family or GGUF architecture added without a
    row there fails here, as does a row for one that went away."""
    from kiln.compiler.gguf_import import ARCHITECTURES
    from kiln.models.config import SUPPORTED_MODEL_TYPES

    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    rows = [
        line.split("|")[1:4]
        for line in doc.splitlines()
        if line.startswith("| `") and not line.startswith("| `model_type`")  # not the header
    ]
    types = {t.strip(" `") for row in rows for t in row[0].split(",")}
    archs = {a.strip(" `") for row in rows for a in row[2].split(",")} - {"-"}
    assert types == set(SUPPORTED_MODEL_TYPES)
    assert archs == set(ARCHITECTURES)
