"""Speculative decoding: tokens drafted cheaply, then checked by the model in one step.

The verify step. A request that has drafts d1..dk feeds its last accepted token t and the
drafts, k + 1 tokens at positions L..L+k (L: its cached tokens). The step runs as a decode
step of k + 1 rows for that request (runtime/model_runner.py `inputs`): row j is a sequence
of its own whose KV length ends at its own position L + j, over the request's pages. Each
layer writes every row's K/V before any row attends, so row j sees the cache plus t and
d1..dj and nothing later: the causal mask over the drafted positions, with no new kernel.
The step is therefore the compiled decode step itself (the native step on CPU, a capture
bucket of b * (k + 1) rows on CUDA), reading the weights once for all k + 1 rows.

Acceptance. Row j's logits are the model's distribution after t, d1..dj. Rows are sampled
in order exactly as decode steps would sample them (the same sampler, penalties, grammar,
min_new_tokens and the request's own generator); row j's token is kept, and row j + 1 is
looked at only when that token equals d(j+1). For a draft that is a fixed guess (NGRAM's) this
is rejection sampling: d is kept with probability p(d), and otherwise the token is a draw
from p without d, renormalised, so the output follows the model's distribution. The
generator is drawn once per output token, as in decoding: a seeded request's output is the
same, token for token, with or without speculation, and greedy output is too.

Rollback. Rejected drafts' K/V lie past the request's KV length, where nothing reads them
and the next step overwrites them; pages taken for them beyond what the accepted tokens
need go back to the pool in the same step (Scheduler.trim), and the prefix cache only
ever receives whole pages below the KV length, which hold accepted tokens alone.

Drafting (NGRAM). The request's own prompt and output are the corpus: the longest suffix of
its tokens, between --speculative-ngram-min-match-window-size and -max-match-window-size
tokens, that occurred earlier is continued with what followed it then (up to
--speculative-ngram-branch-length tokens, and --speculative-num-draft-tokens - 1). One
index per request maps each n-gram of the shortest window to where it ended; a lookup
extends the most recent candidates backwards to the longest window. A chain only: SGLang's
tree of several branches (--speculative-ngram-max-bfs-breadth) and its corpus shared across
requests (--speculative-ngram-capacity) are not built.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.runtime.sampler import argmax_rows, host_rows
from kiln.runtime.scheduler import Batch

if TYPE_CHECKING:
    from kiln.runtime.model_runner import ModelRunner
    from kiln.runtime.request import Request

# The largest decode batch that may speculate (kiln/core/artefact.py); within it, the
# planner below decides from measured step times whether drafts pay.
from kiln.core.artefact import MAX_SPECULATIVE_BATCH

# Candidates a lookup extends backwards (the most recent first): a bound on the work per
# step however often the shortest n-gram recurs.
NGRAM_CANDIDATES = 32
# Row counts whose step time the engine measures at start (others interpolated), and the
# weight a new observation gets in the running estimate.
TIMED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
# Cached tokens of the rows that time attention's share of a step.
TIMED_KV = 512
COST_UPDATE = 0.1
# Acceptance before a request has any history: a draft kept with this probability, with
# the weight of this many drafts.
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.5, 4.0
# Drafts a draft model gets verified whatever the planner says, to measure its acceptance.
EXPLORE_DRAFTS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """The artefact's speculation settings (the manifest's runtime.speculative)."""

    algorithm: str
    num_draft_tokens: int  # tokens a verify step feeds a request: the last one + drafts
    ngram_min_window: int
    ngram_max_window: int
    ngram_branch_length: int
    num_steps: int | None = None  # STANDALONE: most tokens the draft model drafts a step
    draft: dict[str, Any] | None = None  # STANDALONE: kiln.core.artefact.DraftRef
    max_batch: int = MAX_SPECULATIVE_BATCH

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> SpeculativeConfig:
        return cls(**entry)

    @property
    def max_drafts(self) -> int:
        return min(self.num_draft_tokens - 1, self.ngram_branch_length)


class NgramIndex:
    """Where each n-gram of one request's tokens ended, for drafting from its own text.

    `tokens` given to `propose` is the request's whole token list (prompt and output so
    far); it only ever grows, so each call indexes just the tokens added since the last."""

    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window, self.max_window = min_window, max_window
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._done = 0  # n-grams ending before this position are indexed

    def _index(self, tokens: Sequence[int]) -> None:
        # An n-gram ending at the last token is left for later: it is the suffix being
        # matched, and must not find itself.
        n = self.min_window
        for end in range(max(self._done, n - 1), len(tokens) - 1):
            key = tuple(tokens[end - n + 1 : end + 1])
            self._ends.setdefault(key, []).append(end)
        self._done = max(self._done, len(tokens) - 1)

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest earlier match of the suffix."""
        n = self.min_window
        if limit <= 0 or len(tokens) <= n:
            return []
        self._index(tokens)
        ends = self._ends.get(tuple(tokens[-n:]))
        if not ends:
            return []
        last = len(tokens) - 1
        best, best_len = -1, 0
        for end in reversed(ends[-NGRAM_CANDIDATES:]):
            length = n
            while (
                length < self.max_window
                and end - length >= 0
                and tokens[end - length] == tokens[last - length]
            ):
                length += 1
            if length > best_len:
                best, best_len = end, length
                if length == self.max_window:
                    break
        return list(tokens[best + 1 : best + 1 + limit])


def drafter(config: SpeculativeConfig) -> NgramIndex:
    """A new request's drafting state."""
    if config.algorithm != "NGRAM":
        raise ValueError(f"speculative algorithm {config.algorithm} is not built")
    return NgramIndex(config.ngram_min_window, config.ngram_max_window)


class StepCosts:
    """Seconds a decode step takes: a part by its row count, plus `per_kv` seconds for each
    cached token a row's attention reads (every row of a verify step reads its request's
    whole cache). The row part is measured at start for TIMED_ROWS at one cached token
    each, interpolated between them (and extended by the last slope past them); every step
    the engine runs then moves the estimate for its row count (a running average)."""

    def __init__(
        self, timed: dict[int, float], max_rows: int, per_kv: float = 0.0, fixed: bool = False
    ) -> None:
        self.per_kv = per_kv
        self.fixed = fixed  # not updated by what steps take (tests pin a cost model)
        points = sorted(timed.items())
        if not points or points[0][0] != 1:
            raise ValueError("step costs need the one-row time")
        self.table = [0.0] * (max_rows + 1)
        for m in range(1, max_rows + 1):
            self.table[m] = _interpolate(points, m)

    def __call__(self, rows: int, kv: int = 0) -> float:
        """Seconds of a step of `rows` rows reading `kv` cached tokens in all."""
        return self.rows(rows) + self.per_kv * kv

    def rows(self, rows: int) -> float:
        if rows < len(self.table):
            return self.table[rows]
        last = len(self.table) - 1
        slope = self.table[last] - self.table[last - 1] if last > 1 else self.table[last]
        return self.table[last] + slope * (rows - last)

    @property
    def size(self) -> int:
        """Row counts below this have an entry of their own."""
        return len(self.table)

    def observe(self, rows: int, kv: int, seconds: float) -> None:
        if not self.fixed and 0 < rows < self.size:
            self.table[rows] += COST_UPDATE * (seconds - self.per_kv * kv - self.table[rows])


def _interpolate(points: list[tuple[int, float]], m: int) -> float:
    for (m0, t0), (m1, t1) in itertools.pairwise(points):
        if m0 <= m <= m1:
            return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
    if len(points) == 1:
        return points[0][1] * m
    (m0, t0), (m1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) / (m1 - m0) * (m - m1)


def rows_kv(kv_len: int, rows: int) -> int:
    """Cached tokens the attention of a request's `rows` decode rows reads in all: row j
    (from 0) sees its kv_len cached tokens, the fed token and the j fed before it."""
    return rows * (kv_len + 1) + rows * (rows - 1) // 2


def acceptance(drafted: int, kept: int, prior: float = PRIOR_ACCEPT) -> float:
    """A request's estimated probability that its next draft is kept (`prior`: before it
    has any history)."""
    return (kept + prior * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)


class DraftRecord:
    """What a draft model's drafts have landed over the server's requests: the prior for a
    new request's acceptance, and the drafts still owed to finding it out. A model whose
    step costs say its drafts do not pay at PRIOR_ACCEPT would otherwise never draft, and
    never learn that it drafts well: until EXPLORE_DRAFTS drafts were verified, a batch the
    planner would not speculate drafts one token anyway."""

    def __init__(self) -> None:
        self.drafted = 0
        self.kept = 0

    def add(self, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.kept += kept

    @property
    def prior(self) -> float:
        return acceptance(self.drafted, self.kept)

    @property
    def exploring(self) -> bool:
        return self.drafted < EXPLORE_DRAFTS


def plan_drafts(
    alphas: Sequence[float], offered: Sequence[int], kv_lens: Sequence[int], cost: StepCosts
) -> list[int]:
    """How many of its offered drafts each request of a decode batch verifies: the choice
    that lands the most tokens per second, expected. Draft i of a request is kept with
    probability alpha**i (each kept only if those before it were), so adding it gains that
    many tokens for one more row, which reads the request's cache (`kv_lens`: each
    request's cached tokens) and the drafts before it; drafts are added best gain first,
    and the best prefix of that order by (expected tokens) / cost is taken (none, when a
    plain decode step is best: a big batch, or drafts rarely kept)."""
    n = len(alphas)
    taken = [0] * n
    rows, tokens, kv = n, float(n), sum(kv_lens) + n
    best, best_at = tokens / cost(rows, kv), 0
    order: list[int] = []
    while True:
        pick, gain = -1, 0.0
        for i in range(n):
            if taken[i] < offered[i]:
                g = alphas[i] ** (taken[i] + 1)
                if g > gain:
                    pick, gain = i, g
        if pick < 0:
            break
        taken[pick] += 1
        order.append(pick)
        rows += 1
        kv += kv_lens[pick] + 1 + taken[pick]
        tokens += gain
        rate = tokens / cost(rows, kv)
        if rate > best:
            best, best_at = rate, len(order)
    chosen = [0] * n
    for i in order[:best_at]:
        chosen[i] += 1
    return chosen


def plan_steps(
    alphas: Sequence[float],
    kv_lens: Sequence[int],
    max_steps: int,
    cost: StepCosts,
    draft_cost: StepCosts,
) -> int:
    """How many tokens a draft model drafts for every request of a decode batch (0: a plain
    decode step): the count that lands the most tokens per second, expected. Drafting k
    costs k draft steps of the batch's rows; verifying them, a step of (k + 1) rows a
    request; a request lands 1 + alpha + ... + alpha**k tokens."""
    n = len(alphas)
    best, best_k = n / cost(n, sum(rows_kv(kv, 1) for kv in kv_lens)), 0
    tokens = float(n)
    for k in range(1, max_steps + 1):
        tokens += sum(a**k for a in alphas)
        kv = sum(rows_kv(kv, k + 1) for kv in kv_lens)
        rate = tokens / (k * draft_cost(n) + cost(n * (k + 1), kv))
        if rate > best:
            best, best_k = rate, k
    return best_k


@dataclass
class DraftSeq:
    """A request's sequence in the draft model's KV pool: the draft's own pages, and how
    many of the request's tokens have their K/V there (model_runner reads these, and the
    LoRA slot, which a draft never has: speculation and adapters do not mix).

    An EAGLE head's (EagleDraft) also: the request's position of its first row (a prefix
    served from the prefix cache has no hidden states from the model, so the head's
    sequence starts after it), the rows made from the model's hidden states (`checked`;
    rows past them were made from the head's own), and the model's hidden states of the
    positions after those, not yet fed (`pending`, blocks of rows, `pending_rows` in all)."""

    pages: list[int]
    kv_len: int = 0
    adapter: int = 0
    start: int = 0
    checked: int = 0
    pending: list[np.ndarray] = field(default_factory=list)
    pending_rows: int = 0


class DraftModel:
    """A STANDALONE artefact's draft model: its own runner and KV pool, a DraftSeq per
    request (`req.draft`). `propose` first feeds the draft every token of the request it
    has not seen (the prompt, then what the last verify step kept) and takes its greedy
    next token, then decodes the rest of the drafts one step at a time; `settle` cuts the
    sequence back to the tokens the model kept; `release` frees its pages."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pool = runner.pool

    def propose(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        """Up to `k` greedy drafts per request (none for a request the draft pool cannot
        hold them for)."""
        live: list[tuple[int, Request, DraftSeq]] = []
        for i, req in enumerate(reqs):
            seq = req.draft if req.draft is not None else DraftSeq([])
            req.draft = seq
            need = self.pool.pages_for(req.num_tokens + k - 1) - len(seq.pages)
            if need > 0:
                if self.pool.free_pages < need:
                    continue
                seq.pages += self.pool.allocate(need)
            live.append((i, req, seq))
        drafts: list[list[int]] = [[] for _ in reqs]
        if not live:
            return drafts
        fed = [req.all_ids[seq.kv_len :] for _, req, seq in live]
        seqs = [seq for _, _, seq in live]
        # The catch-up, whatever its length, is one step (a prefill's form: the last row of
        # each request comes back); a CPU artefact runs it as rows of the native step.
        batch = Batch(seqs, fed, [True] * len(seqs), is_prefill=True)  # type: ignore[arg-type]
        logits = self.runner.forward(batch)
        for seq, tokens in zip(seqs, fed, strict=True):
            seq.kv_len += len(tokens)
        nxt = argmax_rows(logits)
        for (i, _, _), t in zip(live, nxt, strict=True):
            drafts[i].append(t)
        for _ in range(k - 1):
            batch = Batch(seqs, [[drafts[i][-1]] for i, _, _ in live], [True] * len(seqs), False)  # type: ignore[arg-type]
            nxt = argmax_rows(self.runner.forward(batch))
            for seq in seqs:
                seq.kv_len += 1
            for (i, _, _), t in zip(live, nxt, strict=True):
                drafts[i].append(t)
        return drafts

    def settle(self, req: Request) -> None:
        """After a verify step: the draft's K/V is right only up to the tokens kept."""
        if req.draft is not None:
            req.draft.kv_len = min(req.draft.kv_len, req.kv_len)

    def release(self, req: Request) -> None:
        """The request finished or was retracted: its draft pages go back."""
        if req.draft is not None:
            self.pool.free(req.draft.pages)
            req.draft = None


# An EAGLE head's pending hidden states a request may hold (rows the model checked while
# the head drafted nothing for it: a batch too big to speculate); past it the head's
# sequence starts again at the newest.
MAX_PENDING_ROWS = 4096


class EagleDraft(DraftModel):
    """An EAGLE or EAGLE-3 head (models/eagle.py) as a draft model. Its row at position p
    reads the token at p + 1 and a hidden state for p: the model's, for the tokens it
    checked (`keep` takes them from each of the model's steps), the head's own output at
    the row before, for the tokens it drafts. `propose` feeds the head every checked
    position it has not seen (in one step) and takes its greedy guess at the token after
    the request's last, then drafts on from its own hidden states; `settle` cuts the
    head's sequence back to the rows made from the model's hidden states. `hot_ids`: an
    EAGLE-3 head's draft vocabulary, as the model's ids."""

    def __init__(self, runner: ModelRunner, hot_ids: Sequence[int] | None = None) -> None:
        super().__init__(runner)
        self.hot_ids = None if hot_ids is None else np.asarray(hot_ids, dtype=np.int64)

    def keep(self, req: Request, first: int, rows: np.ndarray) -> None:
        """The model's hidden states of `req`'s positions from `first` on (a step's rows of
        tokens it kept)."""
        if not len(rows):
            return
        seq = req.draft
        if seq is not None:
            end = seq.start + seq.kv_len + seq.pending_rows  # the next position it wants
            if first < end:  # a position it holds already (fed again): the same state
                rows = rows[end - first :]
                first = end
            if first > end or seq.pending_rows + len(rows) > MAX_PENDING_ROWS:
                self.release(req)
                seq = None
        if seq is None:  # the head's sequence starts here
            seq = req.draft = DraftSeq([], start=first)
        if len(rows):
            seq.pending.append(rows)
            seq.pending_rows += len(rows)

    def propose(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        live: list[tuple[int, DraftSeq]] = []
        fed: list[list[int]] = []
        for i, req in enumerate(reqs):
            seq = req.draft
            # the positions the model checked and the head has not seen: up to the one
            # before the request's last token (whose hidden state the next step gives)
            if seq is None or seq.start + seq.kv_len + seq.pending_rows != req.num_tokens - 1:
                continue
            if seq.pending_rows == 0:
                continue
            need = self.pool.pages_for(seq.kv_len + seq.pending_rows + k - 1) - len(seq.pages)
            if need > 0:
                if self.pool.free_pages < need:
                    continue
                seq.pages += self.pool.allocate(need)
            begin = seq.start + seq.kv_len
            live.append((i, seq))
            fed.append(req.all_ids[begin + 1 : req.num_tokens])
        if not live:
            return drafts
        seqs = [seq for _, seq in live]
        hidden = np.concatenate([b for seq in seqs for b in seq.pending]).astype(np.float32)
        batch = Batch(seqs, fed, [True] * len(seqs), is_prefill=True)  # type: ignore[arg-type]
        tokens = self._guesses(self.runner.forward(batch, hidden=hidden))
        for seq, f in zip(seqs, fed, strict=True):
            seq.kv_len += len(f)
            seq.checked = seq.kv_len
            seq.pending, seq.pending_rows = [], 0
        for (i, _), t in zip(live, tokens, strict=True):
            drafts[i].append(t)
        for _ in range(k - 1):
            own = host_rows(self.runner.hidden)  # its output at each sequence's last row
            batch = Batch(seqs, [[drafts[i][-1]] for i, _ in live], [True] * len(seqs), False)  # type: ignore[arg-type]
            tokens = self._guesses(self.runner.forward(batch, hidden=own))
            for seq in seqs:
                seq.kv_len += 1
            for (i, _), t in zip(live, tokens, strict=True):
                drafts[i].append(t)
        return drafts

    def _guesses(self, logits: Any) -> list[int]:
        ids = argmax_rows(logits)
        return ids if self.hot_ids is None else [int(self.hot_ids[t]) for t in ids]

    def settle(self, req: Request) -> None:
        """After a verify step: the rows made from the head's own hidden states go (the
        model's hidden states of the tokens it kept come in their place: `keep`)."""
        if req.draft is not None:
            req.draft.kv_len = req.draft.checked
