"""kiln_cpu decode attention over rows of one sequence scored together (prefill and verify
steps as decode rows): against a per-row softmax reference, at every x86-64 level this CPU
runs (AVX-512: 16-lane tiles; AVX2: 8-lane)."""

from __future__ import annotations

import pytest
import torch
from native_libs import HOST_LEVELS, library


def _reference(q, kp, vp, tables, lens, heads, kv_heads, d, page, window, scale, cap, sinks):
    out = torch.empty_like(q)
    group = heads // kv_heads
    for r, (table, n) in enumerate(zip(tables, lens, strict=True)):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = torch.tensor(table)[pos // page] * page + pos % page
        k = kp[:, slots].repeat_interleave(group, 0)  # [heads, keys, d]
        v = vp[:, slots].repeat_interleave(group, 0)
        s = torch.einsum("hkd,hd->hk", k, q[r].view(heads, d)) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        if sinks is not None:
            s = torch.cat([s, sinks[:, None]], 1)
        p = torch.softmax(s.double(), 1).float()[:, : len(slots)]
        out[r] = torch.einsum("hk,hkd->hd", p, v).reshape(-1)
    return out


def _run(lib, q, kp, vp, tables, lens, heads, kv_heads, d, page, window, scale, cap, sinks, det=0):
    width = max(len(t) for t in tables)
    index = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    out = torch.full_like(q, float("nan"))
    rc = lib.kiln_decode_attention(
        q.data_ptr(), q.stride(0), kp.data_ptr(), vp.data_ptr(), kp.shape[1],
        index.data_ptr(), width, kv_lens.data_ptr(), None, out.data_ptr(), q.shape[0], heads,
        kv_heads, d, page, window or 0, scale, 0, 1.0, cap,
        None if sinks is None else sinks.data_ptr(), 2, det,
    )  # fmt: skip
    assert rc == 0
    return out


@pytest.mark.parametrize("level", HOST_LEVELS)
@pytest.mark.parametrize(
    "heads, kv_heads, d", [(9, 3, 64), (4, 1, 256), (6, 2, 80), (2, 2, 16), (4, 2, 8)]
)
@pytest.mark.parametrize("window, cap, sunk", [(0, 0.0, False), (37, 0.0, False), (0, 2.0, True)])
def test_runs_of_rows_match_one_row_at_a_time(level, heads, kv_heads, d, window, cap, sunk):
    torch.manual_seed(d + heads + window)
    page, pages = 16, 48
    kp = torch.randn(kv_heads, pages * page, d)
    vp = torch.randn(kv_heads, pages * page, d)
    order = torch.randperm(pages).tolist()
    a, b, c = order[:14], order[14:16] + order[20:30], order[30:40]  # scattered page tables
    # b shares a's first two pages (a radix-cache prefix), then goes its own way.
    b = a[:2] + b[2:]
    tables, lens = [], []

    def rows(table, first, last):  # rows for positions first..last-1: one a token
        for n in range(first + 1, last + 1):
            tables.append(table)
            lens.append(n)

    rows(a, 0, 150)  # a fresh prompt: chunks of keys, a partial last chunk
    rows(b, 40, 45)  # a later chunk over a shared prefix, right after a's rows
    rows(c, 99, 100)  # a decode row (alone, one row at a time)
    rows(c, 100, 103)  # three more rows of c: too few to make a run
    rows(a, 150, 158)  # a again: a verify step's rows
    q = torch.randn(len(lens), heads * d) * 2
    scale = d**-0.5
    sinks = torch.randn(heads) * 2 if sunk else None
    args = (kp, vp, tables, lens, heads, kv_heads, d, page, window, scale, cap, sinks)
    got = _run(library(level), q, *args)
    want = _reference(q, *args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("level", HOST_LEVELS)
def test_rows_whose_tables_differ_are_not_one_run(level):
    # Two requests at consecutive lengths whose tables agree on the first page only: the
    # second's keys past it are its own, so the rows must not be read through one table.
    torch.manual_seed(5)
    heads, kv_heads, d, page = 2, 1, 16, 4
    kp, vp = torch.randn(kv_heads, 64, d), torch.randn(kv_heads, 64, d)
    one, two = [0, 1, 2, 3], [0, 5, 6, 7]
    tables = [one] * 6 + [two] * 6
    lens = list(range(3, 9)) + list(range(9, 15))
    q = torch.randn(len(lens), heads * d)
    args = (kp, vp, tables, lens, heads, kv_heads, d, page, 0, 0.25, 0.0, None)
    torch.testing.assert_close(_run(library(level), q, *args), _reference(q, *args))


@pytest.mark.parametrize("level", HOST_LEVELS)
def test_deterministic_rows_do_not_depend_on_the_rest_of_the_step(level):
    """--enable-deterministic-inference: a row's output is bitwise the same alone, in any
    batch, inside a run of its sequence's rows (a prompt chunk) or after it (a cache hit's
    one-row extend). Without it, a long row alone splits its keys over the threads and a
    prompt's rows are scored as a run: other arithmetic, other roundings."""
    torch.manual_seed(11)
    heads, kv_heads, d, page = 9, 3, 64, 16
    kp, vp = torch.randn(kv_heads, 40 * page, d), torch.randn(kv_heads, 40 * page, d)
    table = torch.randperm(40).tolist()
    lens = list(range(300, 340))  # a prompt chunk's rows, long enough to split alone
    tables = [table] * len(lens)
    q = torch.randn(len(lens), heads * d)
    shape = (heads, kv_heads, d, page, 0, d**-0.5, 0.0, None)

    def run(rows, det):
        picked = [tables[r] for r in rows], [lens[r] for r in rows]
        return _run(library(level), q[rows].contiguous(), kp, vp, *picked, *shape, det)

    whole = run(list(range(len(lens))), 1)
    for r in (0, 17, 39):
        assert torch.equal(run([r], 1)[0], whole[r])  # alone: a decode or a cache hit's row
        assert torch.equal(run(list(range(r, len(lens))), 1)[0], whole[r])  # a later chunk
    loose = run(list(range(len(lens))), 0)
    assert not all(torch.equal(run([r], 0)[0], loose[r]) for r in (0, 17, 39))
    torch.testing.assert_close(loose, whole, atol=2e-5, rtol=1e-4)
