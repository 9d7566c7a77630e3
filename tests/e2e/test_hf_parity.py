"""kiln against the oracle: transformers on the same checkpoint, fp32.

Greedy ids must be equal for 32 new tokens on a batch of prompts of different lengths
(run batched in kiln, one at a time in transformers), and the logits of every position
of prompt + continuation within 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import kiln_all_logits
from transformers import AutoModelForCausalLM

from kiln import Engine

# One prompt longer than Mistral's 16-token window in the example config.
PROMPTS = [[1, 5, 9, 33], list(range(3, 43)), [7, 8], [1, *range(100, 120)]]
NEW_TOKENS = 32

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2": ("llama", {}),
    "llama3-rope-scaling-tied": ("llama3", {"tie_word_embeddings": True}),
    "mistral-sliding-window": ("mistral", {}),
    "qwen2-qkv-bias-single-kv-head": ("qwen2", {"num_kv_heads": 1}),
    "qwen3-qk-norm-head-dim": ("qwen3", {}),
    # Mixture of experts: Mixtral rescales its top-2 router weights; this Qwen3-MoE does
    # not (norm_topk_prob false) and keeps a dense MLP in layer 0 (mlp_only_layers).
    "mixtral-moe": ("mixtral", {}),
    "qwen3-moe-dense-first-layer": ("qwen3_moe", {}),
    # Qwen2-MoE: a shared expert every token runs, times sigmoid of its own gate
    "qwen2-moe-gated-shared-expert": ("qwen2_moe", {}),
    "olmoe-whole-qk-norms-every-layer-sparse": ("olmoe", {}),
    # GLM-4.5: a partial rotary's reordered rows under per-head q/k norms and biases;
    # DeepSeek V3's grouped sigmoid routing with a standard attention
    "glm4_moe-qk-norm-partial-rope-grouped-routing": ("glm4_moe", {}),
    # YaRN over a pretraining context of 32: prompt and continuation reach past it.
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
    ),
    "gemma2-soft-capped": ("gemma2", {}),
    # Phi-3's fused q/k/v and gate/up tensors, rope over half of each head (Phi-4-mini's
    # partial rotary); LongRoPE has its own test below.
    "phi3-fused-partial-rotary": ("phi3", {"rope_scaling": None}),
    # GPT-OSS: sinks, biases everywhere, sliding then full, clamped SwiGLU experts
    # stored stacked, YaRN without truncation.
    "gpt-oss-sinks-clamped-experts": ("gpt_oss", {}),
    # DeepSeek: latent attention (its pool one latent + rope row a token, kv_b absorbed),
    # V3's sigmoid routing over groups with a correction bias, V2-Lite's softmax one;
    # shared experts and a dense first layer both.
    "deepseek-v3-mla-grouped-sigmoid": ("deepseek_v3", {}),
    "deepseek-v2-mla-grouped-softmax": ("deepseek_v2", {}),
    "gemma-1": ("gemma", {}),
    "granite-multipliers": ("granite", {}),
    "granite-tied": ("granite", {"tie_word_embeddings": True}),
    "granitemoe-stacked-gate-up-experts": ("granitemoe", {}),
    "smollm3-nope-layer": ("smollm3", {}),
    "olmo2-post-norms-whole-qk-norms": ("olmo2", {}),
    "olmo3-sliding-layers-yarn-on-global-ones": ("olmo3", {}),
    "ernie4_5-interleaved-rope": ("ernie4_5", {}),
    "glm-biased-interleaved-partial-rope": ("glm", {}),
    "starcoder2-layernorm-plain-mlp-window": ("starcoder2", {}),
    # Command R+'s: a LayerNorm over each head of q and k, a [heads, dim] weight each
    "cohere-parallel-block-interleaved-rope-qk-norm": ("cohere", {"use_qk_norm": True}),
    # (StableLM's side-by-side form: its GGUF case, against transformers' GGUF loader);
    # StableLM 2 12B's LayerNorm over each head of q and k, a weight of its own each
    "stablelm-quarter-rotary-qkv-bias-qk-layernorm": ("stablelm", {"qk_layernorm": True}),
    "nemotron-layernorm1p-relu2-biases": ("nemotron", {"mlp_bias": True, "attention_bias": True}),
    "arcee-relu2-mlp": ("arcee", {}),
    # with qk_layernorm: one LayerNorm (weight and bias) over each head of q and k
    "phi2-parallel-biased-lm-head-qk-layernorm": ("phi", {"qk_layernorm": True}),
    "helium-interleaved-rope": ("helium", {}),
    "seed_oss-qkv-and-o-biases": ("seed_oss", {}),
    "cohere2-sliding-rope-global-nope": ("cohere2", {}),
    "glm4-four-norms": ("glm4", {}),
    "exaone4-sliding-rope-global-nope": ("exaone4", {}),
    "exaone4-no-window": (
        "exaone4",
        {"sliding_window": None, "layer_types": ["full_attention"] * 2},
    ),
    "gemma3-sliding-and-global": ("gemma3", {}),
    "gemma3-untied-three-layers": (
        "gemma3",
        {
            "tie_word_embeddings": False,
            "num_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
}


def hf_model(path: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_ids_and_logits_match_transformers(case: str, checkpoint, artefact) -> None:
    family, kw = CASES[case]
    engine = Engine(artefact(family, **kw), max_total_tokens=2048)
    hf = hf_model(checkpoint(family, **kw))
    outs = engine.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt), f"prompt of {len(prompt)} tokens"
        seq = prompt + out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        got = kiln_all_logits(engine, seq)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_phi3_longrope_takes_the_table_its_context_length_asks_for(checkpoint, artefact) -> None:
    """LongRoPE (pretraining context 32 in the example): served with a context up to 32 the
    short factors turn every position, as transformers does for sequences up to 32 tokens;
    with the model's own context (256) the long ones, as transformers does for longer."""
    hf = hf_model(checkpoint("phi3"))
    cases = {  # context length -> prompts (with 16 new tokens, within it)
        32: [[1, 5, 9, 33], list(range(3, 13))],
        None: [list(range(3, 43)), [1, *range(100, 140)]],
    }
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    tail = {}
    for context, prompts in cases.items():
        extra = {} if context is None else {"context_length": context}
        engine = Engine(artefact("phi3"), max_total_tokens=1024, **extra)
        for prompt, out in zip(
            prompts, engine.generate(input_ids=prompts, sampling_params=params), strict=True
        ):
            seq = prompt + out["output_ids"]
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0]
            assert out["output_ids"] == hf_greedy(hf, prompt)[:16], (context, len(prompt))
            torch.testing.assert_close(kiln_all_logits(engine, seq), ref, atol=1e-4, rtol=0)
        tail[context] = kiln_all_logits(engine, cases[32][1])[-1]
    # The two tables really differ on the same tokens.
    assert (tail[32] - tail[None]).abs().max() > 1e-2


def test_mistral_window_changes_the_result(checkpoint) -> None:
    """The parity test above only means something if the window bites on the long prompt."""
    windowed = hf_model(checkpoint("mistral"))
    full = hf_model(checkpoint("mistral", sliding_window=None))
    seq = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        a, b = windowed(seq).logits[0, -1], full(seq).logits[0, -1]
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("page_size", [4, 16])
def test_page_size_does_not_change_tokens(page_size: int, artefact) -> None:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    base = Engine(artefact("qwen3"), max_total_tokens=1024).generate(
        input_ids=PROMPTS, sampling_params=params
    )
    paged = Engine(
        artefact("qwen3", compile_args={"page_size": page_size}), max_total_tokens=1024
    ).generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in paged] == [o["output_ids"] for o in base]


def test_text_prompts_through_the_tokenizer(checkpoint, artefact) -> None:
    engine = Engine(artefact("llama"), max_total_tokens=1024)
    hf = hf_model(checkpoint("llama"))
    prompts = ["Hello", "The capital of France is"]
    outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    for text, out in zip(prompts, outs, strict=True):
        ids = engine.tokenizer.encode(text)
        assert out["output_ids"] == hf_greedy(hf, ids)[:8]
        assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == 8
        assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_the_text_part_of_a_gemma3_multimodal_checkpoint(tmp_path) -> None:
    """Gemma3ForConditionalGeneration (a vision tower beside the language model, whose
    weights sit under language_model.model.*): kiln compiles and runs the text part, and
    text-only prompts continue as transformers' whole model continues them."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.example import _randomise_norms, train_tokenizer

    tokenizer = train_tokenizer()
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=len(tokenizer) - 3,
        eoi_token_index=len(tokenizer) - 2,
        image_token_index=len(tokenizer) - 1,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    _randomise_norms(model, 0)
    ckpt = tmp_path / "gemma3-mm"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(ckpt), dtype="float32"), art)
    engine = Engine(art, max_total_tokens=1024)
    outs = engine.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == hf_greedy(model, prompt), f"prompt of {len(prompt)} tokens"


def test_soft_capped_attention_runs_only_where_it_is_computed(checkpoint, tmp_path) -> None:
    """Gemma 2's capped scores and GPT-OSS's sinks: kiln's C decode kernel computes both
    (CPU target); the Triton kernels compute neither, so a CUDA target runs the reference
    kernel for those attention nodes and Triton's for the rest of the graph."""
    import json

    from kiln.args import ServerArgs
    from kiln.compiler.compile import compile_model
    from kiln.core.artefact import graph_file

    def backends(family: str, **flags: str) -> dict[str, set[str]]:
        art = tmp_path / f"{family}-{len(flags)}"
        args = ServerArgs(model_path=str(checkpoint(family)), dtype="float32", **flags)
        compile_model(args, art)
        out: dict[str, set[str]] = {}
        for n in json.loads((art / graph_file(0)).read_text())["nodes"]:
            if "backend" in n.get("meta", {}):
                op = "attend" if n["op"] in ("attention", "rope_attention") else n["op"]
                out.setdefault(op, set()).add(n["meta"]["backend"])
        return out

    from kiln.kernels import catalog

    for attrs, name in (({"softcap": 2.0}, "softcap"), ({"sinks": 1}, "sinks")):
        assert catalog.get("attention", "triton").refuses(attrs) == name
        assert catalog.get("attention", "kiln_cpu").refuses(attrs) is None
    assert backends("gemma2")["attend"] == {"kiln_cpu"}
    assert backends("gpt_oss")["attend"] == {"kiln_cpu"}
    cuda = backends("gemma2", device="cuda", target_isa="sm_90")
    assert cuda["attend"] == {"torch_native"} and cuda["rmsnorm"] == {"triton"}
