"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and merges (a token may only become
text once the next arrives), so each step decodes the tokens since the last settled point
together with the new one and emits only the growth. Text that could still be the start
of a stop string is held back, so a stop string is never streamed and then taken back.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.text = ""  # settled text so far (stop string removed once matched)
        self.emitted = 0  # characters of `text` already handed out
        self._prefix = 0  # ids[_prefix:_read] were decoded last time
        self._read = 0
        self.matched: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip))

    def push(self, token: int) -> None:
        """Add one generated token; sets `matched` when a stop string appears."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return  # an incomplete character or merge: wait for more tokens
        start = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop:
            self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        longest = max(len(s) for s in self.stop)
        lo = max(0, start - longest + 1)
        hits = [(self.text.find(s, lo), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            at, stop = min(hits)
            self.matched = stop
            self.text = self.text[: at + (len(stop) if self.no_stop_trim else 0)]

    def flush(self) -> None:
        """At the end, settle whatever is still pending (e.g. a lone partial character)."""
        if self.matched is None:
            rest = self._decode(self.ids[self._prefix :])
            before = self._decode(self.ids[self._prefix : self._read])
            if len(rest) > len(before):
                self.text += rest[len(before) :]

    def take(self, final: bool) -> str:
        """Text not yet handed out; while running, keep back what may begin a stop string."""
        end = len(self.text)
        if not final and self.stop and self.matched is None:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's reversible map from the printable characters that stand in for
    bytes back to the bytes: printable Latin-1 stands for itself, every other byte for the
    character 256 + its rank among those others."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


_KINDS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def _decoder_kinds(tokenizer: Any) -> frozenset[str]:
    """The decoder types of a fast tokenizer's pipeline (e.g. ByteLevel, ByteFallback),
    read once per tokenizer (serialising the tokenizer is not cheap)."""
    kinds = _KINDS.get(tokenizer)
    if kinds is None:
        try:
            decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        except (AttributeError, ValueError):
            decoder = {}
        found = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        kinds = _KINDS[tokenizer] = frozenset(k for k in found if k)
    return kinds


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes one token stands for. A token may hold part of a UTF-8 character, whose
    decoded text is U+FFFD; its own bytes are what OpenAI's logprob `bytes` report."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token)
    if added is not None:
        return str(added.content if hasattr(added, "content") else added).encode()
    piece = tokenizer.convert_ids_to_tokens(token)
    kinds = _decoder_kinds(tokenizer)
    if isinstance(piece, str) and "ByteLevel" in kinds and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    if isinstance(piece, str) and "ByteFallback" in kinds:
        hit = _BYTE_FALLBACK.fullmatch(piece)
        if hit:
            return bytes([int(hit.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
    return str(tokenizer.decode([token], skip_special_tokens=False)).encode()
