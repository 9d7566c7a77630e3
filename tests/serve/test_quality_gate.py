"""A fast quality gate for CI: each quantization scheme on the real model scores one window of
benchmarks/data/quality_text.txt against the float reference, with bounds loose enough for
noise and tight enough that a broken kernel or scale fails (the full measurement, with its
targets, is `python benchmarks/quality.py`; figures in benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from quality import TEXT, metrics

from kiln import Engine
from kiln.example import fetch

# One xdist worker runs every test of the real SmolLM2 file's compiles (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("smollm2")

# scheme flags -> (largest mean KL, smallest top-1 agreement) over 256 tokens. Measured over
# the whole text (RESULTS.md): int8wo 0.003 / 97%, fp8 0.015 / 93%, int4wo-64 0.22 / 76%,
# w8a8_int8 (activations in int8 too) in RESULTS.md; fp8 KV cache (256 tokens, decoded):
# e4m3 0.0046 / 95.7%, e5m2 0.018 / 92.5%; the GGUF Q4_1 blocks with int8 activations
# (--quantize-activations int8) 0.0028 / 96%, as llama.cpp on the same file.
GATES = {
    "gguf-int8-activations": ({"quantize_activations": "int8"}, 0.01, 0.93),
    "int8wo": ({"torchao_config": "int8wo"}, 0.01, 0.93),
    "fp8": ({"quantization": "fp8"}, 0.05, 0.85),
    "w8a8_int8": ({"quantization": "w8a8_int8"}, 0.05, 0.85),
    "int4wo-64": ({"torchao_config": "int4wo-64"}, 0.3, 0.7),
    # KV pools, fed 4 tokens a step so attention reads the earlier ones from the pool
    # (measured: the same KL as token by token, e4m3 0.0045 vs 0.0047, in a third the time)
    "kv-fp8_e4m3": ({"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"}, 0.02, 0.9),
    "kv-fp8_e5m2": ({"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"}, 0.06, 0.85),
}


@pytest.fixture(scope="module")
def window(real_artefact) -> tuple[Path, list[int], object]:
    gguf = fetch("smollm2")
    engine = Engine(
        real_artefact(gguf, dtype="float32"), max_total_tokens=1024, disable_radix_cache=True
    )
    ids = engine.encode(TEXT.read_text())[:256]
    return gguf, ids, engine.prompt_logits(ids)


@pytest.mark.parametrize("scheme", sorted(GATES))
def test_scheme_passes_its_quality_gate(scheme: str, window, real_artefact) -> None:
    gguf, ids, ref = window
    flags, max_kl, min_top1 = GATES[scheme]
    chunk = 4 if "kv_cache_dtype" in flags else None
    art = real_artefact(gguf, **flags)
    got = Engine(art, max_total_tokens=1024).prompt_logits(ids, chunk=chunk)
    _, kl, top1 = metrics(ref, got, ids)
    n = len(ids) - 1
    assert kl / n <= max_kl and top1 / n >= min_top1, (kl / n, top1 / n)
    # and a gate that a wrong kernel could not pass: the float path against itself
    assert metrics(ref, ref, ids)[1] == 0.0


def test_gptq_checkpoint_passes_its_quality_gate(window, smollm2_gptq: Path, real_artefact):
    """The real model as a GPTQ checkpoint (round-to-nearest 4-bit codes, group 64, integer
    zeros: a grid that cannot hold the GGUF's Q4_1 float mins, so it is lossy against the
    reference): measured KL 0.27 / top-1 70% over these 256 tokens (int4wo-64, whose grid is
    fitted by least squares, 0.22 / 76% over the whole text)."""
    _, ids, ref = window
    got = Engine(real_artefact(smollm2_gptq), max_total_tokens=1024).prompt_logits(ids)
    _, kl, top1 = metrics(ref, got, ids)
    n = len(ids) - 1
    assert kl / n <= 0.4 and top1 / n >= 0.6, (kl / n, top1 / n)
