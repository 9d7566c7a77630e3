"""GGUF import against the oracle: transformers' own GGUF loader on the same file.

Tiny checkpoints are written as GGUF the way llama.cpp's converter lays them out, with every
matrix in one block format; kiln compiles the file and must produce transformers' greedy ids
and logits (both dequantize to fp32), and the tokenizer kiln writes must encode and render
the chat template as transformers' converted one does.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf
from oracle import assert_rounds_like, hf_greedy, kiln_all_logits, round_linear_inputs
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln import Engine
from kiln.args import ServerArgs
from kiln.compiler.ckpt_files import CheckpointError
from kiln.compiler.compile import compile_model
from kiln.compiler.key import compile_key

PROMPTS = [[1, 5, 9, 33], list(range(3, 43)), [7, 8]]
TEXTS = ["The kiln turns clay into stone.", "Hello, world!\n\n  twice  ", "<|user|>hi</s>"]

_GEMMA = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "num_heads": 2,
    "num_kv_heads": 1,
    "layer_types": None,
    "tie_word_embeddings": True,  # as published (transformers' GGUF loader assumes it)
}
# Rows of whole 256-weight super-blocks, for the K-quants (random blocks: see gguf_files).
_K = {"hidden_size": 256, "intermediate_size": 512}
CASES = {
    "llama-f32": ("llama", "F32", {}),
    "llama-q4_k": ("llama", "Q4_K", _K),
    "llama-q6_k": ("llama", "Q6_K", _K),
    "llama-q5_k": ("llama", "Q5_K", _K),
    "llama-q5_1": ("llama", "Q5_1", {}),
    "qwen2-q5_0": ("qwen2", "Q5_0", {}),
    "llama-q8_0": ("llama", "Q8_0", {}),
    # no kernel of their own: held exactly by a wider format (kiln/core/quant.py)
    "llama-q2_k": ("llama", "Q2_K", _K),
    "llama-q3_k": ("llama", "Q3_K", _K),
    "llama-iq4_nl": ("llama", "IQ4_NL", {}),
    "llama-iq4_xs": ("llama", "IQ4_XS", _K),
    "llama-q4_0-tied": ("llama", "Q4_0", {"tie_word_embeddings": True}),
    "llama-q4_1": ("llama", "Q4_1", {}),
    "qwen2-f16-bias": ("qwen2", "F16", {}),
    # transformers' GGUF loader leaves Qwen3's head_dim at its default of 128.
    "qwen3-bf16-qk-norm": ("qwen3", "BF16", {"head_dim": 128, "hidden_size": 256, "num_heads": 2}),
    # Gemma: the file holds no query scale, so llama.cpp's (head_dim) and transformers'
    # (its default 256) agree only where head_dim is 256; nor Gemma 3's layer kinds (every
    # sixth global: both of these layers slide) or Gemma 2's caps (transformers: 50 / 30).
    "gemma3-q8_0": ("gemma3", "Q8_0", _GEMMA),
    # transformers' GGUF loader reads neither a partial rotary nor LongRoPE: Phi-3-mini-4k's
    # shape (fused tensors, whole-head rope) against it; the rest against the checkpoint.
    "phi3-q8_0-fused": ("phi3", "Q8_0", {"rope_scaling": None, "partial_rotary_factor": 1.0}),
    # transformers' loader reads no window for StarCoder 2, llama.cpp runs none
    "starcoder2-q8_0-layernorm": ("starcoder2", "Q8_0", {"sliding_window": None}),
    # transformers' loader reads the rotary share and the side-by-side form from the file
    "stablelm-q8_0-parallel": ("stablelm", "Q8_0", {"use_parallel_residual": True}),
    "gemma2-f32": (
        "gemma2",
        "F32",
        {**_GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
}


@pytest.fixture(scope="module")
def gguf_file(
    checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in made:
            family, qtype, kw = CASES[case]
            out = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            made[case] = write_gguf(checkpoint(family, **kw), out, qtype)
        return made[case]

    return make


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_compiles_to_transformers_greedy_ids_and_logits(
    case: str, gguf_file: Callable[[str], Path], tmp_path: Path
) -> None:
    path = gguf_file(case)
    art = tmp_path / "art"
    result = compile_model(ServerArgs(model_path=str(path)), art)
    assert result.dtype == "float32"
    engine = Engine(art, max_total_tokens=1024)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    outs = engine.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt, 16)
        seq = prompt + out["output_ids"]
        with torch.no_grad():
            ref_logits = hf(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(kiln_all_logits(engine, seq), ref_logits, atol=1e-4, rtol=0)


def test_phi3_gguf_with_longrope_and_partial_rotary_runs_as_its_checkpoint(
    checkpoint: Callable[..., Path], artefact: Callable[..., Path], tmp_path: Path
) -> None:
    """LongRoPE's factor tensors and the rotary width come back from llama.cpp's keys: the
    GGUF file (F32) compiles to what the checkpoint it was written from compiles to."""
    path = write_gguf(checkpoint("phi3"), tmp_path / "phi3.gguf", "F32")
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(path)), art)
    seq = list(range(3, 43))
    for context in (None, 32):
        extra = {} if context is None else {"context_length": context}
        got = Engine(art, max_total_tokens=1024, **extra).prompt_logits(seq[:24])
        ref = Engine(artefact("phi3"), max_total_tokens=1024, **extra).prompt_logits(seq[:24])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_gguf_tokenizer_matches_transformers_conversion(
    gguf_file: Callable[[str], Path], tmp_path: Path
) -> None:
    path = gguf_file("llama-q8_0")
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(path)), art)
    ours = AutoTokenizer.from_pretrained(art / "tokenizer")
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"], skip_special_tokens=True) == text.replace(
            "<|user|>", ""
        ).replace("</s>", "")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    kw = {"add_generation_prompt": True, "tokenize": False}
    assert ours.apply_chat_template(msgs, **kw) == ref.apply_chat_template(msgs, **kw)
    assert ours.eos_token == "</s>" and ours.bos_token == "<s>"


NUMBERS, CASED = "in 2024, 7 kilns!!", "HelloWorld 12345 isn't"


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # llama.cpp's "refact" (Granite 3's files): every digit alone, then GPT-2's split
        ("refact", NUMBERS, ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "7", "Ġkilns", "!!"]),
        ("starcoder", NUMBERS, ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "7", "Ġkilns", "!!"]),
        # "dbrx" (OLMo 2's, cl100k): llama3's split, digits in threes
        ("dbrx", NUMBERS, ["in", "Ġ", "202", "4", ",", "Ġ", "7", "Ġkilns", "!!"]),
        # Llama 3's: the same split, and a whole piece in the vocabulary taken as it is
        ("llama-bpe", NUMBERS, ["in", "Ġ", "202", "4", ",", "Ġ", "7", "Ġkilns", "!!"]),
        # GLM-4's (llama.cpp's CHATGLM4): the same split, whole pieces first too
        ("glm4", NUMBERS, ["in", "Ġ", "202", "4", ",", "Ġ", "7", "Ġkilns", "!!"]),
        # "olmo": GPT-2's split
        ("olmo", NUMBERS, ["in", "Ġ2024", ",", "Ġ7", "Ġkilns", "!!"]),
        # DeepSeek-R1-Distill-Qwen's files: Qwen2's split, digits alone
        (
            "deepseek-r1-qwen",
            NUMBERS,
            ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "7", "Ġkilns", "!!"],
        ),
        # Phi-4-mini's: a capital starts a word, contractions join it, digits in threes
        ("gpt-4o", CASED, ["Hello", "World", "Ġ", "123", "45", "Ġisn't"]),
        # Mistral Nemo's: the same cut without contractions, digits alone
        ("tekken", CASED, ["Hello", "World", "Ġ", "1", "2", "3", "4", "5", "Ġisn", "'t"]),
    ],
)
def test_gguf_pre_tokenizers_split_as_llama_cpp_does(
    pre: str, text: str, pieces: list[str], checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The pieces each pre-tokenizer name cuts a text into, as llama.cpp's regular
    expressions for that name (llama-vocab.cpp; for gpt-4o and tekken the tokenizer files'
    own, which llama.cpp adapts) cut it, before the BPE merges."""
    from tokenizers import Tokenizer

    path = write_gguf(checkpoint("llama"), tmp_path / "m.gguf", "F32", pre=pre)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(path)), art)
    tok = Tokenizer.from_file(str(art / "tokenizer" / "tokenizer.json"))
    assert tok.pre_tokenizer is not None
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] == pieces
    model = json.loads((art / "tokenizer" / "tokenizer.json").read_text())["model"]
    # llama.cpp's rule for Llama 3's and GLM-4's
    assert model["ignore_merges"] == (pre in ("llama-bpe", "glm4"))


def test_a_folder_with_one_gguf_is_auto_detected_and_the_name_is_not_in_the_key(
    gguf_file: Callable[[str], Path], tmp_path: Path
) -> None:
    src = gguf_file("llama-q4_1")
    folder = tmp_path / "some-folder"
    folder.mkdir()
    shutil.copy(src, folder / "renamed.gguf")
    a = compile_key(ServerArgs(model_path=str(src)))
    b = compile_key(ServerArgs(model_path=str(folder)))
    assert a.load_format == b.load_format == "gguf"
    assert a.key != "" and list(b.factors["weights_sha256"].values()) == list(
        a.factors["weights_sha256"].values()
    )
    shutil.copy(src, folder / "second.gguf")
    with pytest.raises(CheckpointError, match="several GGUF files .*renamed.gguf, second.gguf"):
        compile_key(ServerArgs(model_path=str(folder)))


def test_unsupported_gguf_files_are_refused_in_one_line(
    gguf_file: Callable[[str], Path], tmp_path: Path
) -> None:
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="junk.gguf: not a readable GGUF file"):
        compile_model(ServerArgs(model_path=str(bad)), tmp_path / "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="--load-format gguf: no \\*.gguf file"):
        compile_key(ServerArgs(model_path=str(empty), load_format="gguf"))


def test_gguf_blocks_run_as_stored_unless_a_float_dtype_is_asked(
    gguf_file: Callable[[str], Path], tmp_path: Path
) -> None:
    """Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrices compile to quantized
    linears (the parity test above then shows the mapping is exact: Q8_0, Q4_0 / Q4_1 and
    Q5_0 with their float16 scales as stored, Q5_1 and Q5_K as uint5, Q4_K as uint4 with
    scale d sc and min -dmin m per 32, Q6_K as int8 with scale d sc per 16); the tied table
    is quantized with them; F16 and --dtype float32 give float linears."""
    expect = {
        "llama-q8_0": ("int8h", 32),
        "llama-q4_0-tied": ("uint4h", 32),
        "llama-q4_1": ("uint4h", 32),
        "qwen2-q5_0": ("int5h", 32),
        "llama-q4_k": ("uint4k", 32),
        "llama-q6_k": ("int6k", 16),
        "llama-q5_k": ("uint5k", 32),
        "llama-q5_1": ("uint5h", 32),
        "llama-q2_k": ("uint4", 16),
        "llama-q3_k": ("int6k", 16),
        "llama-iq4_nl": ("int8h", 32),
        "llama-iq4_xs": ("int8", 32),
    }
    for case, (fmt, group) in expect.items():
        compile_model(ServerArgs(model_path=str(gguf_file(case))), tmp_path / case)
        nodes = json.loads((tmp_path / case / "graph.json").read_text())["nodes"]
        quant = [n["attrs"] for n in nodes if n["op"].startswith("quant_")]
        assert {(a["format"], a["group"]) for a in quant} == {(fmt, group)}, case
        # Every matrix but the untied lm_head's and the embedding's stays as stored.
        assert len(quant) >= 4 * 2, case
        assert any(n["op"] == "quant_embedding" for n in nodes) == case.endswith("tied")
    for case, flags in (("qwen2-f16-bias", {}), ("llama-q4_1", {"dtype": "float32"})):
        out = tmp_path / f"{case}-float"
        compile_model(ServerArgs(model_path=str(gguf_file(case)), **flags), out)
        nodes = json.loads((out / "graph.json").read_text())["nodes"]
        assert not any(n["op"].startswith("quant_") for n in nodes), case


# Q6_K's int8_a8 at groups of 16 is held to its integer reference in tests/kernels: on
# this tiny random file its logits swing so far on rounding ties that the statistical
# comparison below says nothing either way.
A8_FORMATS = {
    "llama-q8_0": "int8h_a8",  # Q8_0 as stored: float16 scales, no code-sum plane
    "llama-q4_0-tied": "uint4h_a8",
    "llama-q4_1": "uint4h_a8",
    "llama-q4_k": "uint4k_a8",  # the super-block records as stored, in int8 dot products
    "llama-q5_k": "uint5k_a8",
    "qwen2-q5_0": "int5h_a8",
    "llama-q2_k": "uint4_a8",  # Q2_K held as uint4, groups of 16
    "llama-iq4_nl": "int8h_a8",  # IQ4_NL as Q8_0's layout
    "llama-iq4_xs": "int8_a8",
}


@pytest.mark.parametrize("case", sorted(A8_FORMATS))
def test_gguf_blocks_with_int8_activations_match_transformers_rounding_the_same(
    case: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """--quantize-activations int8: every block matrix (the lm_head too, tied or not) runs
    with its input rounded to int8 per block of 32, llama.cpp's way; transformers on the
    same file with the same rounding in front of each Linear gives the same logits up to
    float32 rounding and ties (oracle.assert_rounds_like). One layer: a tie that float
    noise breaks the other way in a later layer's input moves every later position through
    that layer's attention (seen on AVX-512: one near-tie in row 1's down_proj input of a
    2-layer model moved 25 of 40 positions); in one layer only the first q/k/v input is
    read across positions."""
    family, qtype, kw = CASES[case]
    path = write_gguf(checkpoint(family, **kw, num_layers=1), tmp_path / f"{case}.gguf", qtype)
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(path), quantize_activations="int8"), art)
    nodes = json.loads((art / "graph.json").read_text())["nodes"]
    group = 16 if case == "llama-q2_k" else 32  # activations round per weight group
    assert {n["attrs"]["format"] for n in nodes if n["op"].startswith("quant_")} == {
        A8_FORMATS[case]
    }
    assert not any(n["op"] in ("linear", "packed_linear") for n in nodes)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    seq = PROMPTS[1]
    with torch.no_grad():
        plain = hf(torch.tensor([seq])).logits[0]
        round_linear_inputs(hf, group)
        ref = hf(torch.tensor([seq])).logits[0]
    assert_rounds_like(Engine(art, max_total_tokens=1024).prompt_logits(seq), ref, plain)


@pytest.mark.parametrize(
    ("family", "kw"),
    [
        ("gpt_oss", {"swiglu_limit": 7.0}),  # llama.cpp's constant
        ("deepseek_v3", {}),
        ("deepseek_v2", {}),
        ("gemma", {}),
        ("granite", {}),
        ("granitemoe", {}),  # input_linear as llama.cpp splits it: gate and up apart
        # llama.cpp leaves rope out of every fourth layer whatever the config says: four
        # layers, transformers' default no_rope_layers (the same rule)
        ("smollm3", {"num_layers": 4, "no_rope_layers": None}),
        ("olmo2", {}),
        ("olmo3", {"rope_parameters": None}),  # an olmo2 file with sliding layers
        ("ernie4_5", {}),  # rope pairs interleaved in the file as in the checkpoint
        ("exaone4", {}),  # its layers' sliding flags as an array
        # transformers' loader reads qwen2moe and qwen3moe but not their expert widths;
        # llama.cpp makes every layer sparse, rescales Qwen3-MoE's top-k, never Qwen2-MoE's
        ("qwen2_moe", {"mlp_only_layers": []}),
        ("glm4", {}),  # q/k rows and biases as the checkpoint's (GPT-J pairs in llama.cpp)
        # its interleaved pairs are llama.cpp's too: rows as stored; Command R+'s per-head
        # q/k norms [heads, dim]
        ("cohere", {"use_qk_norm": True}),
        ("stablelm", {"qk_layernorm": True}),  # per-head norms stacked [heads, dim]
        ("nemotron", {}),  # LayerNorm1P's weights stored as 1 + w
        ("arcee", {}),  # q/k rows interleaved, as llama.cpp's Llama converter does
        ("olmoe", {}),  # experts stacked
        ("phi", {}),  # the final norm and the lm_head's bias under llama.cpp's names
        # no layer pattern in the file: llama.cpp's every fourth layer global
        ("cohere2", {"num_layers": 4, "layer_types": None}),
        ("qwen3_moe", {"mlp_only_layers": [], "norm_topk_prob": True}),
        # transformers' loader reads llama, but not Llama 3.1's rope_freqs tensor (how
        # llama.cpp's converter writes its scaling): against the checkpoint
        ("llama3", {}),
    ],
)
def test_families_transformers_cannot_read_as_gguf_run_as_their_checkpoints(
    family: str,
    kw: dict,
    checkpoint: Callable[..., Path],
    artefact: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """transformers reads none of these GGUF architectures: each file (F32, as llama.cpp's
    converter writes it: GPT-OSS's experts with gate and up apart, DeepSeek's kv_b as its
    absorbed halves and its experts stacked, the Qwen MoEs' experts stacked and Qwen2-MoE's
    shared-expert gate a vector, Gemma's norms as 1 + w, Granite's and
    SmolLM3's q/k rows interleaved, Granite's multipliers under llama.cpp's keys, OLMo 2's
    post norms, Llama 3.1's rope scaling as a rope_freqs tensor) is held to the checkpoint
    it was written from, whose artefact is held to transformers."""
    path = write_gguf(checkpoint(family, **kw), tmp_path / f"{family}.gguf", "F32")
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(path)), art)
    seq = list(range(3, 43))
    got = Engine(art, max_total_tokens=1024).prompt_logits(seq)
    ref = Engine(artefact(family, **kw), max_total_tokens=1024).prompt_logits(seq)
    # rtol: Llama 3.1's rotary frequencies come from the file's rope_freqs tensor against
    # the config's formula, a few ulp apart (1.07e-5 at a logit of 2.9 on AVX-512)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "qtype",
    ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0", "Q4_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"],
)
def test_block_decoding_equals_the_gguf_packages_bit_for_bit(qtype: str) -> None:
    """kiln's codes and scales of random blocks decode (kiln.core.quant.dequantize, every
    kernel's reference) to the gguf package's floats, bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf_files import random_blocks

    from kiln.core.quant import FORMATS, GGUF_FORMATS, dequantize, from_gguf_blocks

    rows, k = 6, 512
    if qtype in ("Q8_0", "Q4_1"):  # the gguf package makes these itself
        from gguf.quants import quantize as gguf_quantize

        w = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
        raw = gguf_quantize(w, GGMLQuantizationType[qtype])
    else:
        raw = random_blocks((rows, k), qtype, seed=1)
    ref = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, k).astype(np.float32)
    codes, scales = from_gguf_blocks(raw, qtype, rows, k)
    fmt, group = GGUF_FORMATS[qtype]
    form = FORMATS[fmt]
    if form.superblock:  # K-quants: one scale record per super-block of 256, as stored
        assert scales.shape[1:] == (k // 256, form.record_bytes)
        assert codes.max() < {"Q4_K": 16, "Q5_K": 32, "Q6_K": 64, "Q3_K": 36}[qtype]
    else:
        assert scales.shape[1] == k // group
    got = dequantize(torch.from_numpy(codes), torch.from_numpy(scales), fmt).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_a_q5_1_and_q8_0_mix_fuses_into_one_quantized_projection(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """llama.cpp's Q5_K_M keeps v (and the lm_head) in Q8_0 beside Q5_1 q and k: the fused
    q/k/v runs as int8mh, which holds both exactly (the Q8_0 rows with a min of 0, the
    float16 scales of both as they are), not as floats; the other matrices stay uint5h."""
    path = write_gguf(
        checkpoint("llama"), tmp_path / "mix.gguf", "Q5_1", overrides={"v_proj": "Q8_0"}
    )
    art = tmp_path / "art"
    compile_model(ServerArgs(model_path=str(path)), art)
    nodes = json.loads((art / "graph.json").read_text())["nodes"]
    assert not any(n["op"] in ("linear", "packed_linear") for n in nodes)
    formats = {n["attrs"]["format"] for n in nodes if n["op"] == "quant_linear"}
    assert formats == {"int8mh", "uint5h"}
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    seq = PROMPTS[1]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    got = Engine(art, max_total_tokens=1024).prompt_logits(seq)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # with int8 activations: the same parts as int8mh_a8 and uint5h_a8, as transformers
    # rounding each Linear's input per 32 gives
    a8 = tmp_path / "art-a8"
    compile_model(ServerArgs(model_path=str(path), quantize_activations="int8"), a8)
    nodes = json.loads((a8 / "graph.json").read_text())["nodes"]
    formats = {n["attrs"]["format"] for n in nodes if n["op"] == "quant_linear"}
    assert formats == {"int8mh_a8", "uint5h_a8"}
    with torch.no_grad():
        round_linear_inputs(hf, 32)
        rounded = hf(torch.tensor([seq])).logits[0]
    assert_rounds_like(Engine(a8, max_total_tokens=1024).prompt_logits(seq), rounded, ref)
