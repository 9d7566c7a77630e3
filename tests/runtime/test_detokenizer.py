from __future__ import annotations

import pytest

from kiln.example import train_tokenizer
from kiln.runtime.detokenizer import IncrementalDetokenizer

TEXT = "Hello, world! The capital of France is Paris. ünïcödé 日本 ok"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def run(tok, ids, **kw) -> tuple[str, list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    pieces = []
    for t in ids:
        d.push(t)
        pieces.append(d.take(final=False))
        if d.matched:
            break
    d.flush()
    pieces.append(d.take(final=True))
    return "".join(pieces), pieces, d


def test_streamed_pieces_add_up_to_the_full_decode(tok) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    text, pieces, _ = run(tok, ids)
    assert text == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)  # multi-byte characters never split


def test_stop_string_is_never_streamed(tok) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    text, pieces, d = run(tok, ids, stop=("France", "zzz"))
    assert text == "Hello, world! The capital of " and d.matched == "France"
    assert all("Fra" not in p for p in pieces)
    kept, _, _ = run(tok, ids, stop=("France",), no_stop_trim=True)
    assert kept == "Hello, world! The capital of France"


def test_token_bytes_are_the_tokens_own_bytes() -> None:
    """A byte-level BPE token for one byte of a multi-byte character decodes to U+FFFD;
    its bytes are that byte. Special tokens are their text."""
    from kiln.example import train_tokenizer
    from kiln.runtime.detokenizer import token_bytes

    tok = train_tokenizer()
    e_acute = "é".encode()  # two bytes: each a token of its own in this small vocabulary
    ids = tok.encode("é", add_special_tokens=False)
    assert [token_bytes(tok, i) for i in ids] == [e_acute[:1], e_acute[1:]]
    assert tok.decode(ids[:1]) == "\ufffd"
    hello = tok.encode("Hello world", add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in hello) == b"Hello world"
    assert token_bytes(tok, tok.convert_tokens_to_ids("<|user|>")) == b"<|user|>"


def test_token_bytes_with_byte_fallback() -> None:
    """SentencePiece-style tokenizers spell missing bytes as <0xNN> and spaces as U+2581."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from kiln.runtime.detokenizer import token_bytes

    vocab = {"<unk>": 0, "\u2581Hi": 1, "<0xC3>": 2, "<0xA9>": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert [token_bytes(fast, i) for i in (1, 2, 3)] == [b" Hi", b"\xc3", b"\xa9"]
