"""Token selection from the last-position logits of each sequence in a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from kiln.core.lazy import lazy_module
from kiln.runtime.grammar import apply_bitmask, token_bitmask
from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

Logits: TypeAlias = "torch.Tensor | np.ndarray"
"""A step's logits [rows, vocab]: the native step's come as a float32 numpy array (a
plain-greedy step then never touches torch, whose first op after a step that streamed the
weights through the caches costs ~80 us, a dozen of its warm ones), every other runner's
as a tensor."""


def as_tensor(logits: Logits) -> torch.Tensor:
    """Logits as a tensor (a numpy array's memory shared, not copied)."""
    return torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits


def host_rows(out: Logits) -> np.ndarray:
    """A step's output rows (logits, hidden states) as float32 numpy: the native step's
    as they are, a tensor's copied to the host."""
    if isinstance(out, np.ndarray):
        return out
    return out.detach().float().cpu().numpy()


def argmax_rows(logits: Logits) -> list[int]:
    """Each row's argmax (its first maximum; a NaN counts as the maximum, as in torch).
    Host logits go through numpy: torch's CPU argmax is scalar, 0.12 ms a row of SmolLM2's
    49152 logits against numpy's 0.01 (2-core Xeon), a step's worth of the batch-1 decode
    time at 16 rows."""
    if isinstance(logits, np.ndarray):
        return logits.argmax(axis=-1).tolist()
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def new_generator(seed: int | None = None) -> np.random.Generator:
    """A request's random stream (numpy's PCG64): seeded from any 64-bit value, or from
    the OS's entropy. numpy's, not torch's, so that sampling needs no torch."""
    return np.random.Generator(np.random.PCG64(seed))


_UNSEEDED = new_generator()  # the stream of requests without a seed of their own


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    generator: np.random.Generator | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    top_logprobs: int | None = None  # None: no logprobs; k >= 0: the token's plus top k
    # Tokens that may not be picked this step (EOS and stop ids before min_new_tokens).
    suppress: tuple[int, ...] = ()
    grammar: Any = None  # the request's grammar matcher: what it allows next is all it may pick
    logprob_ids: tuple[int, ...] = ()  # with logprobs, these tokens' too (token_ids_logprob)

    @property
    def as_given(self) -> bool:
        """Its token comes from the logits as they are: no penalty, suppressed token,
        grammar or logprobs (greedy or sampled)."""
        return (
            not self.params.penalised
            and not self.suppress
            and self.grammar is None
            and self.top_logprobs is None
        )

    @property
    def plain(self) -> bool:
        """Its token is the logits' argmax as they are."""
        return self.params.greedy and self.as_given


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    # (token, logprob) of each token the request named (SGLang's token_ids_logprob), in its
    # order.
    ids: tuple[tuple[int, float], ...] = ()


def sample(
    logits: Logits, rows: Sequence[SamplingRow]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row. A constrained row's grammar mask first, then penalties; greedy
    rows take the argmax, the others sample after temperature, top-k, top-p and min-p with
    their own generator. Logprobs are of the masked, penalised distribution before
    temperature, as OpenAI reports them. Rows without a grammar pay nothing for it; a step
    of plain rows (`SamplingRow.plain`) is one argmax, and a native step's rows are chosen
    in numpy (`_host_row`: the same tokens, logprobs to float32 rounding), so that a
    server of native steps imports torch only for a grammar (xgrammar's matchers are
    torch's)."""
    if all(r.plain for r in rows):
        return argmax_rows(logits), [None] * len(rows)
    if isinstance(logits, np.ndarray) and all(r.grammar is None for r in rows):
        with np.errstate(all="ignore"):  # overflows are held at float32's extremes
            picked = [_host_row(logits[i], r) for i, r in enumerate(rows)]
        return [t for t, _ in picked], [lp for _, lp in picked]
    logits = as_tensor(logits).float()
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained or any(r.params.penalised or r.suppress for r in rows):
        logits = logits.clone()
    if constrained:
        mask = token_bitmask([rows[i].grammar for i in constrained], logits.shape[-1])
        apply_bitmask(logits, mask, constrained)
    for i, r in enumerate(rows):
        if r.params.penalised:
            _penalise(logits[i], r)
            _finite(logits[i])
        if r.suppress:
            ids = list(r.suppress)
            kept = logits[i, ids].clone() if r.grammar is not None else None
            logits[i, ids] = float("-inf")
            if kept is not None and not torch.isfinite(logits[i]).any():
                logits[i, ids] = kept  # the grammar can only end here
    tokens = argmax_rows(logits)
    for i, r in enumerate(rows):
        if not r.params.greedy:
            probs = _filtered_probs(logits[i], r.params)
            tokens[i] = _draw(probs, r.generator)
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    for i, r in enumerate(rows):
        if r.top_logprobs is not None:
            logprobs[i] = _logprob(logits[i], tokens[i], r.top_logprobs, r.logprob_ids)
    return tokens, logprobs


def token_logprobs(
    logits: Logits, tokens: Sequence[int], k: int, ids: tuple[int, ...] = ()
) -> list[TokenLogprob]:
    """Row j's log-probability of tokens[j], with the row's top k and the logprobs of
    `ids`, as `sample` reports a chosen token's (a prompt's logprobs: row j the logits after
    prompt token j, tokens[j] prompt token j + 1)."""
    if isinstance(logits, np.ndarray):
        with np.errstate(all="ignore"):
            return [_host_logprob(logits[j], t, k, ids) for j, t in enumerate(tokens)]
    rows = as_tensor(logits).float()
    return [_logprob(rows[j], t, k, ids) for j, t in enumerate(tokens)]


def _logprob(row: torch.Tensor, token: int, k: int, ids: tuple[int, ...] = ()) -> TokenLogprob:
    # Clamped: a token penalised or suppressed to -inf has no finite logprob, and JSON has
    # no -Infinity.
    lp = torch.log_softmax(row, dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    top = torch.topk(lp, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else ()
    named = tuple(zip(ids, lp[list(ids)].tolist(), strict=True)) if ids else ()
    return TokenLogprob(token, float(lp[token]), pairs, named)


def _host_row(row: np.ndarray, r: SamplingRow) -> tuple[int, TokenLogprob | None]:
    """One row of a native step's logits in numpy: what `sample`'s torch path does to a
    row without a grammar, in the same order (penalties, suppressed tokens, the argmax or
    a draw, logprobs)."""
    if r.params.penalised or r.suppress:
        row = row.copy()
        if r.params.penalised:
            _host_penalise(row, r)
            _host_finite(row)
        if r.suppress:
            row[list(r.suppress)] = -np.inf
    if r.params.greedy:
        token = int(row.argmax())
    else:
        token = _host_draw(_host_probs(row, r.params), r.generator)
    if r.top_logprobs is None:
        return token, None
    return token, _host_logprob(row, token, r.top_logprobs, r.logprob_ids)


def _host_penalise(row: np.ndarray, r: SamplingRow) -> None:
    """`_penalise` in numpy, float32 as torch computes it (a division by the penalty, not
    a product with its reciprocal: other bits)."""
    p = r.params
    if p.logit_bias:
        ids = np.array([t for t, _ in p.logit_bias], dtype=np.int64)
        row[ids] += np.array([b for _, b in p.logit_bias], dtype=np.float32)
    if p.repetition_penalty != 1.0:
        seen = np.array(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=np.int64)
        vals = row[seen]
        penalty = np.float32(p.repetition_penalty)
        row[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    if r.output_ids and (p.frequency_penalty or p.presence_penalty):
        # Only the tokens that occurred: the others would lose a zero.
        ids, counts = np.unique(np.asarray(r.output_ids, dtype=np.int64), return_counts=True)
        cut = np.float32(p.frequency_penalty) * counts.astype(np.float32)
        row[ids] -= cut + np.float32(p.presence_penalty)


def _host_finite(row: np.ndarray) -> None:
    """`_finite` in numpy: NaN and +inf held at float32's extremes, -inf kept."""
    big = np.finfo(np.float32).max
    row[np.isnan(row)] = -big
    row[np.isposinf(row)] = big


def _host_logprob(row: np.ndarray, token: int, k: int, ids: tuple[int, ...] = ()) -> TokenLogprob:
    """The token's log-probability, the k largest and those of `ids`, as `sample`'s torch
    path reports them (clamped at float32's lowest; largest first, ties by token id). Only
    those are computed: the row's log-sum-exp, then its top k (`_host_top`)."""
    high = row.max()
    lse = np.log(np.exp(row - high).sum(dtype=np.float32))
    low = np.finfo(np.float32).min

    def logprob(at: np.ndarray) -> np.ndarray:
        return np.maximum((row[at] - high) - lse, low)

    top: tuple[tuple[int, float], ...] = ()
    if k:
        best = _host_top(row, min(k, row.size))
        top = tuple(zip(best.tolist(), logprob(best).tolist(), strict=True))
    named: tuple[tuple[int, float], ...] = ()
    if ids:
        named = tuple(zip(ids, logprob(np.array(ids)).tolist(), strict=True))
    return TokenLogprob(token, float(logprob(np.array([token]))[0]), top, named)


TOP_BLOCK = 256  # `_host_top`'s block of the row


def _host_top(row: np.ndarray, k: int) -> np.ndarray:
    """The indices of the row's k largest values, largest first, ties by index. They lie
    in the k blocks of TOP_BLOCK values with the largest maxima (ties by block index) and
    the row's tail after its last whole block: a block with a smaller maximum than k
    others' holds no value above k others. 70-90 us for k 1-5 of 49,152 values where an
    argpartition of the whole row took 140 (a Zen 3 core)."""
    n = row.size
    blocks = n // TOP_BLOCK
    highs = row[: blocks * TOP_BLOCK].reshape(blocks, TOP_BLOCK).max(axis=1)
    chosen = np.lexsort((np.arange(blocks), -highs))[:k]
    ids = np.concatenate(
        (
            (chosen[:, None] * TOP_BLOCK + np.arange(TOP_BLOCK)).ravel(),
            np.arange(blocks * TOP_BLOCK, n),
        )
    )
    vals = row[ids]
    kth = np.partition(vals, vals.size - k)[vals.size - k]
    above = ids[vals > kth]
    tied = np.sort(ids[vals == kth])[: k - above.size]
    top = np.concatenate((above, tied))
    return top[np.lexsort((top, -row[top]))]


def _draw(probs: torch.Tensor, generator: np.random.Generator | None) -> int:
    """One token drawn from `probs` (a distribution, zeros allowed) by inverting its CDF at
    a uniform number from the request's generator: 77 us over a 49,152-token vocabulary
    where torch.multinomial takes 1 ms (an exponential per token), a quarter of a 16-row
    sampled decode step of the real model. A zero-probability token adds nothing to the
    CDF, so it is never drawn."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    u = (generator or _UNSEEDED).random()
    index = torch.searchsorted(cdf, u * cdf[-1], right=True)
    return min(int(index), probs.numel() - 1)


DRAW_BLOCK = 256  # tokens a host draw sums at a time


def _host_draw(probs: np.ndarray, generator: np.random.Generator | None) -> int:
    """`_draw` in numpy, for host rows: the same inversion of the CDF, found by block
    (float64 sums of 256 tokens, then a CDF inside the one block the number falls in),
    since numpy's float64 cumsum of 49,152 values took 0.2-0.6 ms here against 0.03 for
    the block sums. A token of probability zero is never drawn."""
    wide = probs.astype(np.float64)
    starts = np.arange(0, wide.size, DRAW_BLOCK)
    cdf = np.cumsum(np.add.reduceat(wide, starts))
    target = (generator or _UNSEEDED).random() * cdf[-1]
    b = min(int(np.searchsorted(cdf, target, side="right")), len(cdf) - 1)
    block = wide[starts[b] : starts[b] + DRAW_BLOCK]
    inner = np.cumsum(block) + (cdf[b - 1] if b else 0.0)
    j = min(int(np.searchsorted(inner, target, side="right")), block.size - 1)
    if block[j] == 0.0:  # past the block's end by rounding: its last token that can be
        j = int(np.flatnonzero(block[: j + 1])[-1])
    return int(starts[b]) + j


def _host_probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """`_filtered_probs` in numpy, for a native step's logits row: temperature, top-k,
    top-p and min-p the same, float32 throughout (a logit of -inf, or one the
    temperature overflows, held at float32's extremes: the same probabilities)."""
    big = np.finfo(np.float32).max
    x = row / np.float32(p.temperature)
    np.clip(x, -big, big, out=x)
    if np.isnan(x).any():
        x[np.isnan(x)] = 0.0
    n = x.size
    if 0 < p.top_k < n:
        # Only the kept logits' exponentials (the rest are exp(-inf), zeros in place: the
        # same sum in the same order); numpy's exp of a whole row took ~0.1 ms.
        kth = np.partition(x, n - p.top_k)[n - p.top_k]
        kept = np.flatnonzero(x >= kth)
        top = x[kept]
        probs = np.zeros_like(x)
        probs[kept] = np.exp(top - top.max())
    else:
        x -= x.max()
        probs = np.exp(x, out=x)
    probs /= probs.sum()
    if p.top_p < 1.0:
        probs = _host_nucleus(probs, p.top_p)
    if p.min_p > 0.0:
        probs[probs < np.float32(p.min_p) * probs.max()] = 0.0
    return probs / probs.sum()


def _host_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """`_nucleus` in numpy. Zeros (top-k's cut) are set aside first: they end the
    descending order, so they change no sum before a positive probability, and numpy's
    argpartition of a row of mostly equal values is its slow path (2.1 ms with top_k 50's
    49,102 zeros; a 16-row top_k 50, top_p 0.9 step took 48.7 ms, a Zen 3 core). Then the
    probabilities above max x each of NUCLEUS_CUTS, at most HOST_NUCLEUS_FIRST of them, are
    sorted alone: a model's nucleus is usually tens of tokens (16 rows of SmolLM2 at
    temperature 0.8, top_p 0.95: 1.17 ms against 4.56 for the argpartition below, the same
    tokens). Else the prefix among the k largest (argpartition, then a sort of those k), k
    growing 8x until the k-th is dropped; a full sort past that. k starts at 1024, not 256:
    numpy's argpartition of 49,152 costs the same ~0.13 ms at either and the sort of 1024
    ~0.04 ms, so a nucleus of a few hundred tokens (top_p 0.95 at temperature 0.8 kept 429
    of SmolLM2's) takes one round, not two."""
    nonzero = probs != 0  # a bool mask: numpy's flatnonzero of floats took 0.2 ms
    if not nonzero.all():
        positive = np.flatnonzero(nonzero)
        out = np.zeros_like(probs)
        out[positive] = _host_nucleus(probs[positive], top_p)
        return out
    high = probs.max()
    for scale in NUCLEUS_CUTS:
        # Every probability above a cut: when their running sum passes top_p (by a margin
        # over float32 rounding), they hold the whole nucleus (the tokens below come after
        # all of them, each with more than top_p before it), and only they are sorted.
        above = probs > high * np.float32(scale)
        if np.count_nonzero(above) > HOST_NUCLEUS_FIRST:
            break
        idx = np.flatnonzero(above)
        idx = idx[np.argsort(-probs[idx], kind="stable")]
        top = probs[idx]
        running = _running_sum(top)
        if running[-1] > top_p + NUCLEUS_MARGIN:
            keep = running - top <= top_p
            out = np.zeros_like(probs)
            out[idx[keep]] = top[keep]
            return out
    n, k = probs.size, HOST_NUCLEUS_FIRST
    while k < n:
        idx = np.argpartition(probs, n - k)[n - k :]
        idx = idx[np.argsort(-probs[idx], kind="stable")]
        top = probs[idx]
        before = _running_sum(top) - top
        if before[-1] > top_p:
            keep = before <= top_p
            out = np.zeros_like(probs)
            out[idx[keep]] = top[keep]
            return out
        k *= 8
    idx = np.argsort(-probs, kind="stable")
    top = probs[idx]
    out = np.zeros_like(probs)
    keep = _running_sum(top) - top <= top_p
    out[idx[keep]] = top[keep]
    return out


def _running_sum(x: np.ndarray) -> np.ndarray:
    """float32 running sums as torch's cumsum makes them (accumulated in float64, each
    rounded to float32); numpy's float32 cumsum accumulates in float32, and over a
    nucleus of thousands its error moved the boundary by whole tokens."""
    return np.cumsum(x.astype(np.float64)).astype(np.float32)


def _penalise(row: torch.Tensor, r: SamplingRow) -> None:
    p = r.params
    vocab, device = row.numel(), row.device  # the logits' device: the GPU's on a GPU
    if p.logit_bias:  # token ids were checked against the vocabulary at admission
        row[torch.tensor([t for t, _ in p.logit_bias], device=device)] += torch.tensor(
            [b for _, b in p.logit_bias], device=device
        )
    if p.repetition_penalty != 1.0:
        # As transformers and vLLM: over prompt and output tokens, shrink positive logits
        # and grow negative ones.
        ids = sorted(set(r.prompt_ids) | set(r.output_ids))
        seen = torch.tensor(ids, dtype=torch.long, device=device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if r.output_ids and (p.frequency_penalty or p.presence_penalty):
        out = torch.tensor(list(r.output_ids), device=device)
        counts = torch.bincount(out, minlength=vocab)[:vocab]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _finite(row: torch.Tensor) -> None:
    """Penalties may push a logit past float32's range (a repetition_penalty of 1e-38
    divides by it): held at the largest finite values, so no inf - inf makes a NaN and the
    order of the tokens is kept. A -inf (a token the grammar forbids) stays impossible."""
    big = torch.finfo(row.dtype).max
    masked = torch.isneginf(row)
    torch.nan_to_num_(row, nan=-big, posinf=big, neginf=-big)
    row[masked] = float("-inf")


NUCLEUS_FIRST = 256  # the largest probabilities top_p looks at first
HOST_NUCLEUS_FIRST = 1024  # the same, in numpy (`_host_nucleus`)
NUCLEUS_CUTS = (1e-3, 1e-5)  # `_host_nucleus` first sorts the probabilities above these x max
NUCLEUS_MARGIN = 1e-6  # ... once their sum passes top_p by more than float32 rounding


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` with only the smallest prefix, largest first, whose mass reaches top_p (at
    least one token): a token stays if the mass before it is at most top_p. The prefix is
    found among the k largest (k = 256, then 8x more) once the k-th of them is dropped,
    and every later token with it (ties at the boundary may keep another of equal
    probability than a full sort would); a full sort only when it is not (or for NaN). A
    sort of SmolLM2's 49,152 probabilities took 4.5 ms on a Zen 3 core, as long as a whole
    batch-1 decode step there; the 256 largest take a fraction of that."""
    n, k = probs.numel(), NUCLEUS_FIRST
    while k < n:
        top, idx = torch.topk(probs, k)
        before = top.cumsum(0) - top
        if before[-1] > top_p:  # the k-th is dropped: the prefix ends before it
            keep = before <= top_p
            return torch.zeros_like(probs).scatter_(0, idx[keep], top[keep])
        k *= 8
    sorted_p, idx = probs.sort(descending=True)
    drop = sorted_p.cumsum(0) - sorted_p > top_p
    sorted_p[drop] = 0.0
    return torch.zeros_like(probs).scatter_(0, idx, sorted_p)


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    # A small temperature may overflow finite logits; -inf (suppressed tokens) stays -inf.
    row = torch.nan_to_num(
        row / p.temperature, posinf=torch.finfo(row.dtype).max, neginf=float("-inf")
    )
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()
