"""A request's state as it moves through the scheduler, and what one step reports of it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.sampler import TokenLogprob
from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V are in the pool
    finish_reason: dict[str, Any] | None = None
    generator: np.random.Generator | None = None  # runtime/sampler.py new_generator
    top_logprobs: int | None = None  # None: no logprobs wanted
    # With logprobs: these tokens' at every reported position too (token_ids_logprob).
    logprob_ids: tuple[int, ...] = ()
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # The prompt's logprobs (a scorer's request): None, not wanted; k >= 0, each prompt
    # token's after the first, with the top k. Entry j is prompt token j + 1's.
    prompt_top_logprobs: int | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_reported: bool = False  # handed out in a RequestOutput
    detok: IncrementalDetokenizer | None = None
    priority: int = 0
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    started_at: float | None = None  # when it first ran (left the waiting queue)
    retractions: int = 0
    reported: int = 0  # output tokens already handed out in a RequestOutput
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_node: Any = None  # the prefix-cache node this request holds locked
    tree_len: int = 0  # tokens of its first pages that are the prefix cache's (cache_node's)
    # Its whole pages' names in the prefix cache's disk tier (runtime/kv_store.py), as far
    # as they were needed: the chain of digests grows with the request, never changes.
    page_names: list[bytes] = field(default_factory=list)
    # SGLang's extra_key / cache_salt: shares cached prefixes only with requests of the
    # same key (runtime/radix_cache.py)
    cache_key: str | None = None
    # Its LoRA adapter (--enable-lora, runtime/lora.py): the name, and the runner's slot
    # holding it (0: the base model alone).
    lora: str | None = None
    adapter: int = 0
    grammar: Any = None  # its constraint's matcher (runtime/grammar.py), if it has one
    drafter: Any = None  # its NGRAM drafting state (runtime/speculative.py)
    draft: Any = None  # its sequence in a draft model's KV pool (speculative.DraftSeq)
    spec_verify_ct: int = 0  # verify steps it took part in with drafts
    spec_drafted: int = 0  # drafted tokens verified
    spec_accepted: int = 0  # drafted tokens the model kept
    # An embedding model's request (a Matryoshka model): its vector cut to this many
    # features before it is normalised; None, the whole hidden state.
    dimensions: int | None = None
    # Its sampler row once nothing is suppressed any more (past min_new_tokens): every
    # field is a reference that stays (engine.py _sampling_row).
    sampling_row: Any = None
    # An embedding model's (ModelSpec.is_embedding): its last prompt token's final hidden
    # state, L2-normalised, once its prompt is in.
    embedding: list[float] | None = None
    # return_hidden_states (an --enable-return-hidden-states artefact): the final hidden
    # state of each prompt token, then of each token fed after it (SGLang's meta_info
    # hidden_states: the prompt's rows, then one a generated token but the last).
    return_hidden_states: bool = False
    hidden_states: list[list[float]] = field(default_factory=list)

    @property
    def prefix_space(self) -> str | tuple[int, str | None] | None:
        """The prefix-cache tree it shares pages in (runtime/radix_cache.py): its cache
        key's, within its adapter's (an adapter's K/V differ from the base model's). By
        slot, never reused: an adapter loaded again under the same name gets new trees."""
        return self.cache_key if not self.adapter else (self.adapter, self.cache_key)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """The last token (what a decode step feeds), without copying the context."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scoring(self) -> bool:
        """It wants every prompt row's logits (its prompt's logprobs, or its prompt's
        hidden states) and has not had all of them yet: its prompt is computed whole."""
        if self.return_hidden_states and len(self.hidden_states) < len(self.prompt_ids):
            return True
        return (
            self.prompt_top_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        )

    @property
    def scores_only(self) -> bool:
        """It wants its prompt's logprobs and no new token: it ends when its prompt is in."""
        return self.prompt_top_logprobs is not None and self.params.max_new_tokens == 0


@dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one request: the new tokens and text since the last one."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # With speculative decoding, SGLang's spec_* meta_info of the request so far.
    spec: dict[str, Any] | None = None
    # The prompt's logprobs (Request.prompt_logprobs), in the first output that has them.
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # an embedding model's, in its last output
    # return_hidden_states: every row so far (Request.hidden_states), in its last output
    hidden_states: list[list[float]] | None = None


def hidden_meta(prompt_len: int, rows: list[list[float]]) -> list[Any]:
    """SGLang's meta_info hidden_states from a request's rows by position: the prompt's
    rows as one list of rows, then one row a generated token (but the last, never fed)."""
    return [rows[:prompt_len], *rows[prompt_len:]] if rows else []


def prompt_positions(prompt_len: int, scored: list[TokenLogprob]) -> list[TokenLogprob | None]:
    """Each prompt position's logprob from Request.prompt_logprobs (entry j: position j +
    1's): None for the first token (nothing before it) and for any not computed."""
    return [None, *scored[: prompt_len - 1]] + [None] * (prompt_len - 1 - len(scored))


def logprob_meta(
    output: list[TokenLogprob],
    named: bool,
    text: Callable[[int], str | None] | None = None,
    prompt: list[int] | None = None,
    scored: list[TokenLogprob] | None = None,
    start: int = -1,
) -> dict[str, list[Any]]:
    """SGLang's logprob fields of meta_info, each entry (logprob, token id, text), the
    text `text(id)` where given (return_text_in_logprobs), else None: output_token_logprobs,
    output_top_logprobs, with `named` output_token_ids_logprobs (token_ids_logprob's); with
    `start` >= 0 the prompt's from that position too (input_*: `scored` is
    Request.prompt_logprobs, the first token's logprob None: nothing comes before it)."""

    def name(token: int) -> str | None:
        return text(token) if text is not None else None

    def entries(pairs: tuple[tuple[int, float], ...]) -> list[tuple[float, int, str | None]]:
        return [(v, t, name(t)) for t, v in pairs]

    meta: dict[str, list[Any]] = {
        "output_token_logprobs": [(lp.logprob, lp.token, name(lp.token)) for lp in output],
        "output_top_logprobs": [entries(lp.top) for lp in output],
    }
    if named:
        meta["output_token_ids_logprobs"] = [entries(lp.ids) for lp in output]
    if prompt is not None and scored is not None and start >= 0:
        at = prompt_positions(len(prompt), scored)[start:]
        meta["input_token_logprobs"] = [
            (lp.logprob if lp else None, t, name(t))
            for lp, t in zip(at, prompt[start:], strict=True)
        ]
        meta["input_top_logprobs"] = [entries(lp.top) if lp else None for lp in at]
        if named:
            meta["input_token_ids_logprobs"] = [entries(lp.ids) if lp else None for lp in at]
    return meta
