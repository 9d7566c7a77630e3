"""Grammar-constrained decoding with xgrammar (`--grammar-backend`, SGLang's flag).

A request may carry one constraint: a JSON schema (`json_schema`, OpenAI's
`response_format`), a regular expression (`regex`), an EBNF grammar (`ebnf`) or an xgrammar
structural tag (`structural_tag`). `Grammars.compile` turns it into a compiled grammar once
(a bounded cache keyed by the constraint, on the server's grammar threads: never on the
event loop or the engine thread), and each request gets its own `GrammarMatcher`. Every step the
engine fills the bitmask of the constrained rows only (`token_bitmask`), the sampler masks
their logits before penalties and filters, and each sampled token advances its matcher;
a matcher that reaches the end of its grammar ends the request as a stop. Rows without a
constraint pay nothing.

The compiler needs the vocabulary as xgrammar reads it (`TokenizerInfo`): built on first
use, from a transformers tokenizer over the artefact's tokenizer files, so a server that
never sees a constraint never imports transformers for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# What a request may constrain its output with (SGLang's sampling parameter names).
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Grammars kept compiled: a client cannot grow the cache without bound.
CACHE_SIZE = 256
_NEG_INF = np.float32(-np.inf)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the field."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: its kind and its text (a schema as JSON text)."""

    kind: str
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)


class Grammars:
    """The compiler of a server's constraints, for one tokenizer and vocabulary."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        any_whitespace: bool = True,
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.any_whitespace = any_whitespace
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of `constraint` (cached); GrammarError names the field."""
        with self._lock:
            hit = self._cache.get(constraint.key)
            if hit is not None:
                self._cache.move_to_end(constraint.key)
                return hit
        compiled = self._compile(constraint)
        with self._lock:
            self._cache[constraint.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher of `compiled`, for one request."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def _compile(self, c: Constraint) -> Any:
        compiler = self._get_compiler()
        try:
            if c.kind == "json_schema":
                return compiler.compile_json_schema(c.text, any_whitespace=self.any_whitespace)
            if c.kind == "regex":
                return compiler.compile_regex(c.text)
            if c.kind == "ebnf":
                return compiler.compile_grammar(c.text)
            return compiler.compile_structural_tag(c.text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            first = _LOG_PREFIX.sub("", first)  # "[01:57:21] /project/cpp/x.cc:83: "
            raise GrammarError(f"{c.kind}: does not compile: {first[:300]}") from None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    _transformers_tokenizer(self.tokenizer),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                # xgrammar caches compiled grammars itself too; kiln's cache above bounds
                # the number, this the bytes.
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=64 << 20
                )
            return self._compiler


def token_bitmask(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each matcher, as xgrammar's bitmask [rows, vocab / 32]."""
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(mask, i)
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of rows `rows` of `logits` (float32, contiguous) become -inf, in
    place; `mask` holds one row per entry of `rows`. On CPU the bits are unpacked with
    numpy: 0.6 ms for 16 rows of a 49,152-token vocabulary where xgrammar's CPU path takes
    3.1 ms (benchmarks/structured_bench.py measures the whole cost)."""
    if logits.device.type != "cpu":
        import xgrammar

        # xgrammar reads the mask row of each logits row it is given: a full-batch mask.
        full = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
        full[rows] = mask
        xgrammar.apply_token_bitmask_inplace(
            logits, full.to(logits.device), vocab_size=logits.shape[-1], indices=rows
        )
        return
    vocab = logits.shape[-1]
    # Bit j of 32-bit word i allows token 32 * i + j: little-endian bytes, low bit first.
    words = mask.numpy().astype("<i4", copy=False).view(np.uint8)
    allowed = np.unpackbits(words, axis=-1, bitorder="little")[:, :vocab].view(bool)
    out = logits.numpy()
    for k, row in enumerate(rows):
        np.copyto(out[row], _NEG_INF, where=~allowed[k])


def constraint_of(params: dict[str, Any]) -> Constraint | None:
    """The one constraint a sampling-parameter dict names, or None; ValueError (naming the
    fields) for several, or for one of the wrong type."""
    given = [k for k in KINDS if params.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"{', '.join(given)}: give at most one constraint")
    if not given:
        return None
    kind = given[0]
    value = params[kind]
    if kind in ("json_schema", "structural_tag") and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind}: expected a non-empty string, got {str(value)[:40]!r}")
    return Constraint(kind, value)


def _transformers_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer for xgrammar's vocabulary reading: the tokenizer itself when
    it is one, else one over kiln's own tokenizer's `tokenizers` object."""
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "is_fast"):
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
