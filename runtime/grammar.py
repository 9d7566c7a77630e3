"""Grammar-constrained decoding (`--grammar-backend`, SGLang's flag): xgrammar (the
default), llguidance or outlines (outlines-core's regex index: regular expressions and
JSON schemas, as SGLang's outlines backend).

A request may carry one constraint: a JSON schema (`json_schema`, OpenAI's
`response_format`), a regular expression (`regex`), an EBNF grammar (`ebnf`) or an xgrammar
structural tag (`structural_tag`, xgrammar only). `Grammars.compile` turns it into a
compiled grammar once (a bounded cache keyed by the constraint, on the server's grammar
threads: never on the event loop or the engine thread), and each request gets its own
matcher. Every step the engine fills the bitmask of the constrained rows only
(`token_bitmask`; the three libraries write the same layout, bit j of word i allowing
token 32 i + j), the sampler masks their logits before penalties and filters, and each sampled
token advances its matcher; a matcher that reaches the end of its grammar ends the request
as a stop. Rows without a constraint pay nothing.

The compiler needs the vocabulary as the library reads it (xgrammar's `TokenizerInfo`,
llguidance's `LLTokenizer`, outlines-core's `Vocabulary` of each token's bytes, read from
xgrammar's decoding of the vocabulary, special tokens left out): built on first use,
from a transformers tokenizer over the artefact's tokenizer files, so a server that never
sees a constraint never imports transformers for it. JSON schemas allow any whitespace
between tokens unless --constrained-json-disable-any-whitespace; with llguidance and
outlines, --constrained-json-whitespace-pattern gives the whitespace as a regular
expression (outlines' own default, without it, is one optional space).
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
        backend: str = "xgrammar",
        whitespace_pattern: str | None = None,
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.any_whitespace = any_whitespace
        self.backend, self.whitespace_pattern = backend, whitespace_pattern
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
        if self.backend == "llguidance":
            return GuidanceMatcher(self._get_compiler(), compiled)
        if self.backend == "outlines":
            return OutlinesMatcher(compiled, self.stop_token_ids)
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def _compile(self, c: Constraint) -> Any:
        compiler = self._get_compiler()
        if self.backend == "llguidance":
            return self._guidance_grammar(compiler, c)
        if self.backend == "outlines":
            return self._outlines_index(compiler, c)
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

    def _guidance_grammar(self, tokenizer: Any, c: Constraint) -> str:
        """llguidance's grammar of `c` (its serialised form), checked against the
        vocabulary; GrammarError names the field."""
        from llguidance import LLMatcher, grammar_from

        if c.kind == "structural_tag":
            raise GrammarError("structural_tag: xgrammar's; not with --grammar-backend llguidance")
        try:
            if c.kind == "json_schema":
                ws: dict[str, Any] = {"whitespace_flexible": self.any_whitespace}
                if self.whitespace_pattern is not None:
                    ws["whitespace_pattern"] = self.whitespace_pattern
                grammar = LLMatcher.grammar_from_json_schema(c.text, defaults=ws)  # type: ignore[arg-type]
            else:
                grammar = grammar_from(c.kind, c.text)  # type: ignore[arg-type]
            error = LLMatcher.validate_grammar(grammar, tokenizer)
        except Exception as e:  # llguidance raises ValueError / TypeError on a bad input
            error = str(e) or type(e).__name__
        if error:
            first = (error.strip().splitlines() or ["invalid"])[0]
            raise GrammarError(f"{c.kind}: does not compile: {first[:300]}")
        return grammar

    def _outlines_index(self, vocabulary: Any, c: Constraint) -> Any:
        """outlines-core's index of `c` over the vocabulary; GrammarError names the field."""
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        if c.kind not in ("json_schema", "regex"):
            raise GrammarError(
                f"{c.kind}: not with --grammar-backend outlines (regular expressions and JSON "
                "schemas only, as SGLang's outlines backend)"
            )
        pattern = self.whitespace_pattern
        if pattern is None and not self.any_whitespace:
            pattern = ""  # --constrained-json-disable-any-whitespace: compact JSON
        try:
            regex = c.text if c.kind == "regex" else build_regex_from_schema(c.text, pattern)
            return Index(regex, vocabulary)
        except Exception as e:  # outlines-core raises ValueError / TypeError / its own
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise GrammarError(f"{c.kind}: does not compile: {first[:300]}") from None

    def _outlines_vocabulary(self) -> Any:
        """outlines-core's vocabulary: each token's bytes (xgrammar's decoding, which knows
        byte-level and byte-fallback tokenizers) but the special and stop tokens, whose
        first stop token is its end of sequence."""
        import xgrammar
        from outlines_core import Vocabulary

        if not self.stop_token_ids:
            raise GrammarError("--grammar-backend outlines: the model has no stop token")
        tok = _transformers_tokenizer(self.tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        special = {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}
        special |= {*info.special_token_ids, *self.stop_token_ids}
        tokens: dict[bytes, list[int]] = {}
        for i, text in enumerate(info.decoded_vocab):
            if text and i not in special:
                tokens.setdefault(text, []).append(i)
        return Vocabulary(self.stop_token_ids[0], tokens)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None and self.backend == "outlines":
                self._compiler = self._outlines_vocabulary()
            if self._compiler is None and self.backend == "llguidance":
                from llguidance.hf import from_tokenizer

                self._compiler = from_tokenizer(
                    _transformers_tokenizer(self.tokenizer),
                    n_vocab=self.vocab_size,
                    eos_token=self.stop_token_ids or None,
                )
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


class GuidanceMatcher:
    """An llguidance matcher with the part of xgrammar's GrammarMatcher the engine uses."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        from llguidance import LLMatcher

        self._m = LLMatcher(tokenizer, grammar, log_level=0)

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def fill_next_token_bitmask(self, mask: torch.Tensor, index: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, mask, index)


class OutlinesMatcher:
    """An outlines-core guide with the part of xgrammar's GrammarMatcher the engine uses.
    Its index knows one end-of-sequence token: where it allows that one, every stop token
    of the model is allowed, and taking one ends the match."""

    def __init__(self, index: Any, stop_ids: Sequence[int]) -> None:
        from outlines_core import Guide

        self._guide = Guide(index)
        self._stops = frozenset(stop_ids)
        self._done = False

    def accept_token(self, token: int) -> bool:
        if self._done:
            return False
        if token in self._stops:
            self._done = bool(self._guide.is_finished())
            return self._done
        try:
            self._guide.advance(token, return_tokens=False)
        except ValueError:  # a token the guide does not allow here
            return False
        return True

    def is_terminated(self) -> bool:
        return self._done

    def fill_next_token_bitmask(self, mask: torch.Tensor, index: int) -> None:
        row = mask[index]
        self._guide.write_mask_into(row.data_ptr(), row.numel(), 4)
        if self._guide.is_finished():  # its one end-of-sequence bit stands for every stop
            for t in self._stops:
                if t < 32 * row.numel():
                    row[t // 32] |= _bit(t % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int the word can hold (bit 31 is the sign)."""
    return -(1 << 31) if j == 31 else 1 << j


def token_bitmask(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each matcher, as a bitmask [rows, vocab / 32] (int32)."""
    mask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
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
