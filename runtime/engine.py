"""The offline engine: `Engine("art/").generate(prompts, sampling_params)`, as in SGLang."""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from kiln.args import ServerArgs
from kiln.args.stages import refuse_compile_time_changes
from kiln.runtime.artefact import Artefact
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.sampler import sample
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler

log = logging.getLogger("kiln.engine")

DEFAULT_MAX_RUNNING = 256
DEFAULT_CPU_MEM_FRACTION = 0.3


def _available_memory() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Engine:
    """Loads an artefact and generates.

    Keyword arguments are server arguments by field name (`max_total_tokens=...`). Runtime
    ones take effect; compile-time ones must agree with the artefact, else ArgError."""

    def __init__(self, artefact: str | Path, **server_args: Any) -> None:
        self.args = ServerArgs(**server_args)
        self.art = Artefact.open(artefact)
        refuse_compile_time_changes(server_args, self.art.manifest)
        spec = self.art.spec
        self.context_length = min(
            self.args.context_length or spec.context_length, spec.context_length
        )
        self.tokenizer = (
            None if self.args.skip_tokenizer_init else _load_tokenizer(self.art.tokenizer_dir)
        )
        max_running = self.args.max_running_requests or DEFAULT_MAX_RUNNING
        self.runner = ModelRunner(self.art, self._kv_tokens(max_running))
        self.scheduler = Scheduler(self.runner.pool, max_running, self.args.max_prefill_tokens)
        self._eos = set(spec.eos_token_ids)
        self._ids = itertools.count()
        self._rng = (
            torch.Generator().manual_seed(self.args.random_seed)
            if self.args.random_seed is not None
            else None
        )

    def _kv_tokens(self, max_running: int) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        spec = self.art.spec
        per_token = KVCache.bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.torch_dtype
        )
        fraction = self.args.mem_fraction_static or DEFAULT_CPU_MEM_FRACTION
        budget = int(_available_memory() * fraction) // per_token
        # No request can use more than the context, so a larger pool would stay empty.
        return max(spec.page_size, min(budget, self.context_length * max_running))

    # -- the public API ---------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (
            input_ids is not None and (not input_ids or isinstance(input_ids[0], int))
        )
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self._encode(p) for p in prompts]
        else:
            ids_list = [input_ids] if single else list(input_ids)  # type: ignore[list-item, arg-type]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(
                    f"{len(sampling_params)} sampling_params for {len(ids_list)} prompts"
                )
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        requests = []
        for ids, p in zip(ids_list, params, strict=True):
            for i in range(p.n):
                requests.append(self._make_request(list(ids), p, i))
        self.run(requests)
        results = [self._result(r) for r in requests]
        return results[0] if single and len(results) == 1 else results

    def run(self, requests: list[Request]) -> None:
        """Run `requests` to completion (continuous batching over the whole set)."""
        for req in requests:
            if not self._finish_if_done(req):
                self.scheduler.add(req)
        while self.scheduler.has_work:
            self.step()

    def step(self) -> list[Request]:
        """One engine iteration: schedule, run, postprocess. Returns requests that finished."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.waiting:
                raise MemoryError(
                    "the KV pool cannot fit the next waiting request; raise --max-total-tokens"
                )
            return []
        logits = self.runner.forward(batch)
        tokens = sample(
            logits, [r.params for r in batch.requests], [r.generator for r in batch.requests]
        )
        self.scheduler.commit(batch, tokens)
        now = time.perf_counter()
        done = []
        for req in batch.requests:
            if req.first_token_at is None:
                req.first_token_at = now
            if self._finish_if_done(req):
                done.append(req)
        return done

    # -- internals --------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this artefact has no tokenizer: pass input_ids instead of text")
        return list(self.tokenizer.encode(text))

    def _make_request(self, ids: list[int], params: SamplingParams, index: int) -> Request:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.art.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        gen = None
        if params.sampling_seed is not None:
            gen = torch.Generator().manual_seed(params.sampling_seed + index)
        elif self._rng is not None:
            gen = torch.Generator().manual_seed(
                int(torch.randint(2**62, (1,), generator=self._rng))
            )
        return Request(f"req-{next(self._ids)}", ids, params, generator=gen)

    def _finish_if_done(self, req: Request) -> bool:
        p = req.params
        reason: dict[str, Any] | None = None
        if req.output_ids:
            last = req.output_ids[-1]
            if (not p.ignore_eos and last in self._eos) or last in p.stop_token_ids:
                reason = {"type": "stop", "matched": last}
        if reason is None and (
            len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= self.context_length
        ):
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is None:
            return False
        self.scheduler.finish(req, reason)
        return True

    def _result(self, req: Request) -> dict[str, Any]:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                req.output_ids, skip_special_tokens=req.params.skip_special_tokens
            )
        end = time.perf_counter()
        return {
            "text": text,
            "output_ids": list(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": 0,
                "finish_reason": req.finish_reason,
                "e2e_latency": end - req.created,
            },
        }

    def shutdown(self) -> None:
        """Release the KV pool and weights (the engine is unusable afterwards)."""
        del self.runner


def _load_tokenizer(path: Path) -> Any:
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
