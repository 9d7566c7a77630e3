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
