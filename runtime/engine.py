"""The engine: an artefact, its model runner, a scheduler and a tokenizer.

`add_request` / `abort` / `step` are the whole interface the server's engine thread uses;
`generate` is the offline API SGLang and vLLM users know:
    Engine("art/").generate(["Hello"], {"temperature": 0, "max_new_tokens": 32})
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.args import ArgError, ServerArgs, flag_true
from kiln.args.stages import refuse_compile_time_changes
from kiln.core import artefact as fmt
from kiln.core.lazy import lazy_module
from kiln.runtime import numa
from kiln.runtime.artefact import Artefact, ModelSpec, checked_manifest, model_spec
from kiln.runtime.batch_log import BatchLog
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.grammar import Grammars
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.kv_store import check_tier, open_store
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.parallel import TPGroup, check_nodes
from kiln.runtime.placement import KVDemand, Placement, available_ram, gpu_memory, place
from kiln.runtime.radix_cache import RadixCache
from kiln.runtime.request import Request, RequestOutput, hidden_meta, logprob_meta
from kiln.runtime.sampler import (
    Logits,
    SamplingRow,
    TokenLogprob,
    argmax_rows,
    as_tensor,
    host_rows,
    new_generator,
    sample,
    token_logprobs,
)
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Batch, Scheduler, SchedulerConfig
from kiln.runtime.speculative import (
    MAX_SPECULATIVE_BATCH,
    TIMED_KV,
    TIMED_ROWS,
    DraftModel,
    DraftRecord,
    EagleDraft,
    SpeculativeConfig,
    StepCosts,
    acceptance,
    drafter,
    plan_drafts,
    plan_steps,
    rows_kv,
)
from kiln.runtime.threads import default_threads, set_threads
from kiln.runtime.tokenizer import TokenizerError, import_tokenizer_libraries, load_tokenizer

if TYPE_CHECKING:
    import torch

    from kiln.runtime.lora import Adapter
    from kiln.runtime.profiler import StepProfile
else:
    torch = lazy_module("torch")

log = logging.getLogger("kiln.engine")

DEFAULT_MAX_RUNNING = 256
# --max-running-requests unset with speculative decoding: SGLang's NGRAM default.
DEFAULT_MAX_RUNNING_SPECULATIVE = 48
# --chunked-prefill-size unset: SGLang's size for the device's memory (its server_args.py,
# from the GPU's memory, or on a CPU the smallest NUMA node's): (below MiB, tokens), then
# the largest; DEFAULT_CHUNKED_PREFILL where the memory is unknown.
CHUNKED_PREFILL_BY_MEMORY = ((35 * 1024, 2048), (60 * 1024, 4096), (160 * 1024, 8192))
LARGEST_CHUNKED_PREFILL = 16384
DEFAULT_CHUNKED_PREFILL = 4096
# Longest the engine spends giving KV memory back in one go (it does so when idle).
RELEASE_BUDGET_S = 0.05
# An embedding model's requests: the prompt, then its pooled state (no token is sampled).
EMBED = SamplingParams(max_new_tokens=1, temperature=0.0)
# Tokens one request's token_ids_logprob may name (each reported at every position: 128
# over a 4096-token answer is half a million logprobs).
MAX_LOGPROB_IDS = 128


class RequestError(ValueError):
    """A request kiln cannot run as given (empty, too long, unknown tokens...)."""


class RankLost(RuntimeError):
    """A tensor-parallel rank died during the step."""


class NanLogits(RuntimeError):
    """A step's logits held NaN, with --crash-on-nan: the server stops."""


class Engine:
    """Loads an artefact and generates.

    Keyword arguments are server arguments by field name (`max_total_tokens=...`). Runtime
    ones take effect; compile-time ones must agree with the artefact, else ArgError."""

    def __init__(
        self, artefact: str | Path, file_check: fmt.FileCheck | None = None, **server_args: Any
    ) -> None:
        """`file_check`: the artefact's checksums already under way (`kiln serve` starts
        them before its imports); used where it covers the manifest read here."""
        self.args = ServerArgs(**server_args)
        if self.args.dp_size > 1:
            raise ArgError(
                f"--dp-size {self.args.dp_size}: an engine is one replica; `kiln serve` runs "
                "several behind a router"
            )
        if self.args.node_rank > 0:
            raise ArgError(
                f"--node-rank {self.args.node_rank}: an engine is rank 0, on node 0; the other "
                f"nodes run their ranks with `kiln serve ARTEFACT --nnodes "
                f"{self.args.nnodes} --node-rank K --dist-init-addr HOST:PORT`"
            )
        # The tokenizer's libraries are imported beside the artefact's checksums (hashlib lets
        # go of the GIL); joined before the tokenizer is read (transformers' lazy module
        # cannot be imported from two threads at once).
        skip_tokenizer = self.args.skip_tokenizer_init
        importer = threading.Thread(
            target=import_tokenizer_libraries,
            args=(Path(artefact),),
            name="kiln-import",
            daemon=True,
        )
        if not skip_tokenizer:
            importer.start()
        # Where this rank runs and its pool's size come first, once the manifest fits this
        # host (versions, target), from its bounded numbers (held to the graph at open).
        manifest = checked_manifest(Path(artefact), verify=False)
        spec = model_spec(manifest)
        # --numa-node: this process (rank 0) on its node before any weight is read, so that
        # the pages it touches come from there; ranks 1.. bind themselves (rank_worker).
        self.numa = self._bind_numa(spec.tp_size // self.args.nnodes)
        # without --threads, each rank's share of its node's cores (runtime/numa.py)
        self.numa_threads = numa.shares(self.numa) if self.numa else None
        asked = self.args.context_length
        if asked is not None and asked > spec.context_length:
            raise ArgError(
                f"--context-length: {asked} is longer than the model's "
                f"{spec.context_length} (max_position_embeddings)"
            )
        self.context_length = asked or spec.context_length
        self.speculative = (
            SpeculativeConfig.from_manifest(spec.speculative) if spec.speculative else None
        )
        self.max_running = self.args.max_running_requests or (
            DEFAULT_MAX_RUNNING_SPECULATIVE if self.speculative else DEFAULT_MAX_RUNNING
        )
        self.placement = self._place(manifest, spec)
        self.art = Artefact.open(
            artefact,
            trust_remote_code=self.args.trust_remote_code,
            device=self.placement.device,
            manifest=manifest,
            file_check=file_check,
            mapped=not self.args.weight_loader_disable_mmap,
        )
        refuse_compile_time_changes(server_args, self.art.manifest)
        if self.args.nnodes > 1:
            check_nodes(spec.tp_size, self.args.nnodes, self.args.dist_init_addr)
        check_tier(self.args, self.art.device, spec.tp_size)
        if importer.is_alive():
            importer.join()
        self.tokenizer = None if skip_tokenizer else self._load_tokenizer()
        self.grammars = self._grammars(spec)
        self.threads, threads_from = _set_threads(self.args.threads, self.numa, self.numa_threads)
        kv_tokens = self.placement.kv_tokens
        self.runner = ModelRunner(self.art, kv_tokens, self.context_length)
        # --enable-lora: adapter name -> its slot in the runner (runtime/lora.py), and its
        # folder; unloaded adapters' slots, freed once no request holds them
        self.adapter_paths: dict[str, str] = {}
        self._retiring: set[int] = set()
        self._next_slot = 1  # a slot is never reused: no request can alias another's
        self.adapters: dict[str, int] = {}
        if self.args.enable_lora:
            self._load_adapters()
        if spec.tp_size > 1:
            self._start_ranks(kv_tokens)
        self.runner.warm_up()
        self.draft_model = self._draft_model(kv_tokens)
        self.draft_record = DraftRecord()  # what drafts have landed, over every request
        self.step_costs = self._time_steps() if self.speculative else None
        self.draft_costs = (
            StepCosts(
                self.draft_model.runner.time_decode(range(1, MAX_SPECULATIVE_BATCH + 1)),
                MAX_SPECULATIVE_BATCH,
            )
            if self.draft_model is not None
            else None
        )
        cache = None
        if not self.args.disable_radix_cache:
            cache = RadixCache(self.runner.pool, self.args.radix_eviction_policy)
        # --hicache-storage-backend file: the prefix cache's disk tier (runtime/kv_store.py)
        self.kv_store = open_store(self.args, self.art, self.runner.kv)
        self.scheduler = Scheduler(
            self.runner.pool,
            self._scheduler_config(),
            cache,
            self.kv_store,
            write_policy=self.args.hicache_write_policy,
        )
        self.batch_log = BatchLog(self.args.decode_log_interval, self.scheduler, self.runner.pool)
        # --enable-nan-detection: NaN logits are read as -1e5 (never sampled) and logged;
        # --crash-on-nan: the batch's requests fail and `_on_fatal` (the server) stops.
        self.crash_on_nan = flag_true(self.args.crash_on_nan)
        self.nan_detection = self.args.enable_nan_detection or self.crash_on_nan
        self._on_fatal: Callable[[str], None] | None = None
        if self.draft_model is not None:
            self.scheduler.on_release = self.draft_model.release
        self._eos = set(spec.eos_token_ids)
        self._rng = (
            new_generator(self.args.random_seed % 2**64)
            if self.args.random_seed is not None
            else None
        )
        self._live: dict[str, Request] = {}
        self.profile: StepProfile | None = None  # /start_profile's (runtime/profiler.py)
        log.info("%s; threads: %d (%s)", self.describe(), self.threads, threads_from)

    def _bind_numa(self, processes: int) -> list[int] | None:
        """--numa-node: the nodes of this machine's ranks, this process bound to the
        first (runtime/numa.py)."""
        if not self.args.numa_node:
            return None
        nodes = numa.check(self.args.numa_node, processes, f"{processes} tensor-parallel rank(s)")
        numa.bind(nodes[0])
        return nodes

    def _draft_model(self, kv_tokens: int) -> DraftModel | None:
        """A STANDALONE artefact's draft model or an EAGLE one's head (its artefact in
        draft/, opened under the same rules), with a KV pool of as many tokens as the
        model's."""
        spec = self.speculative
        if spec is None or spec.draft is None:
            return None
        draft = Artefact.open(
            self.art.root / fmt.DRAFT_DIR,
            trust_remote_code=self.args.trust_remote_code,
            device=self.placement.device,
            mapped=not self.args.weight_loader_disable_mmap,
            model=self.art,
        )
        if draft.spec.vocab_size != self.art.spec.vocab_size:
            raise fmt.ArtefactError(
                f"{self.art.root}/{fmt.DRAFT_DIR}: a vocabulary of {draft.spec.vocab_size}, "
                f"the model's is {self.art.spec.vocab_size}"
            )
        runner = ModelRunner(draft, kv_tokens, self.context_length)
        runner.warm_up()
        if spec.algorithm in ("EAGLE", "EAGLE3"):
            return EagleDraft(runner, spec.draft.get("hot_ids"))
        return DraftModel(runner)

    def _time_steps(self) -> StepCosts:
        """What decode steps cost here (the speculative planner's input): by row count,
        and per cached token a row reads; measured now, refined by every step served."""
        assert self.speculative is not None
        most = self.speculative.max_batch * self.speculative.num_draft_tokens
        timed = self.runner.time_decode([m for m in TIMED_ROWS if m <= most])
        per_kv = 0.0
        if self.runner.pool.pages_for(TIMED_KV) <= self.runner.pool.free_pages:
            rows = 4
            long = self.runner.time_decode([rows], kv=TIMED_KV)[rows]
            per_kv = max(0.0, (long - timed[rows]) / (rows * (TIMED_KV - 1)))
        log.info(
            "speculative %s: decode step of 1 / 4 / %d rows %.2f / %.2f / %.2f ms, "
            "and %.2f us per cached token a row reads",
            self.speculative.algorithm,
            max(timed),
            timed[1] * 1e3,
            timed.get(4, math.nan) * 1e3,
            timed[max(timed)] * 1e3,
            per_kv * 1e6,
        )
        return StepCosts(timed, most, per_kv)

    def _grammars(self, spec: ModelSpec) -> Grammars | None:
        """The constraint compiler (runtime/grammar.py), unless --grammar-backend none or
        the server has no tokenizer."""
        backend = self.args.grammar_backend or "xgrammar"
        pattern = self.args.constrained_json_whitespace_pattern
        if pattern is not None and backend not in ("llguidance", "outlines"):
            raise ArgError(
                "--constrained-json-whitespace-pattern: only with --grammar-backend llguidance "
                "or outlines (xgrammar takes --constrained-json-disable-any-whitespace)"
            )
        if backend == "none" or self.tokenizer is None:
            return None
        package = {"llguidance": "llguidance", "outlines": "outlines_core"}.get(backend)
        if package is not None:
            try:
                importlib.import_module(package)
            except ImportError:
                raise ArgError(
                    f"--grammar-backend {backend}: needs the {package} package: "
                    f"pip install 'kiln[{backend}]'"
                ) from None
        return Grammars(
            self.tokenizer,
            spec.vocab_size,
            spec.eos_token_ids,
            any_whitespace=not self.args.constrained_json_disable_any_whitespace,
            backend=backend,
            whitespace_pattern=pattern,
        )

    def _load_tokenizer(self) -> Any:
        try:
            return load_tokenizer(self.art.tokenizer_files())
        except TokenizerError as e:
            raise fmt.ArtefactError(f"{self.art.root}/{fmt.TOKENIZER_DIR}/{e}") from None

    def describe(self) -> str:
        """What runs: model, dtype, how decode steps run, kernels per op, KV pool."""
        spec, pool = self.art.spec, self.runner.pool
        backends: dict[str, set[str]] = {}
        for n in self.art.graph.nodes:
            for key, phase in (("backend", ""), ("prefill_backend", " prefill")):
                if key in n.meta:
                    backends.setdefault(n.op, set()).add(f"{n.meta[key]}{phase}")
        kernels = ", ".join(f"{op} {'/'.join(sorted(b))}" for op, b in sorted(backends.items()))
        tokens = pool.num_pages * pool.page_size
        return (
            f"{spec.served_model_name}: {spec.dtype} on {self.runner.device}; decode: "
            f"{self.runner.decode_mode(self.art)}; kernels: {kernels}; KV pool: {tokens} "
            f"tokens ({pool.num_pages} pages of {pool.page_size}), "
            f"{self.runner.kv.nbytes / 2**30:.2f} GiB reserved"
            + (", committed as used" if self.runner.device == "cpu" else "")
        )

    def _scheduler_config(self) -> SchedulerConfig:
        a = self.args
        chunk = a.chunked_prefill_size or chunked_prefill_for(device_memory_mib(self.runner.device))
        return SchedulerConfig(
            max_running=self.max_running,
            max_prefill_tokens=a.max_prefill_tokens,
            chunked_prefill_size=None if chunk == -1 else chunk,
            mixed_chunk=a.enable_mixed_chunk,
            policy=a.schedule_policy,
            priority=a.enable_priority_scheduling,
            low_priority_first=a.schedule_low_priority_values_first,
            preemption_threshold=a.priority_scheduling_preemption_threshold,
            conservativeness=a.schedule_conservativeness,
            seed=a.random_seed or 0,
            prefill_max_requests=a.prefill_max_requests,
            max_loras=a.max_loras_per_batch if a.enable_lora else None,
            continuous_decode_steps=a.num_continuous_decode_steps,
        )

    def _load_adapters(self) -> None:
        """--lora-paths' adapters, each into a slot of the runner's LoRA bank; an adapter
        that cannot be served stops the start with an ArgError naming it."""
        from kiln.runtime.lora import LoraBank, LoraError, parse_lora_paths, read_adapter

        a = self.args
        try:
            if self.speculative is not None:
                raise LoraError("LoRA with speculative decoding is not supported")
            bank = LoraBank(self.art.graph, a.lora_target_modules, str(self.runner.device))
            self.runner.enable_lora(bank)
            sources = parse_lora_paths(a.lora_paths or ())
            if a.max_loaded_loras is not None and len(sources) > a.max_loaded_loras:
                raise LoraError(
                    f"--lora-paths: {len(sources)} adapters; --max-loaded-loras is "
                    f"{a.max_loaded_loras}"
                )
            for source in sources:
                self._add_adapter(read_adapter(source, a.max_lora_rank))
        except LoraError as e:
            raise ArgError(f"--enable-lora: {e}") from None
        names = ", ".join(self.adapters) or "none yet"
        log.info("LoRA: %d adapters (%s)", len(self.adapters), names)

    def _add_adapter(self, adapter: Adapter) -> None:
        """`adapter` into the next slot (LoraError if it does not fit the model, or a
        tensor-parallel rank could not load it)."""
        from kiln.runtime.lora import LoraError

        assert self.runner.lora is not None
        self.runner.lora.add(self._next_slot, adapter)
        if self.runner.group is not None:  # serving: the other ranks load it too
            try:
                self._share_adapter(self._next_slot, adapter.name, adapter.path)
            except LoraError:
                self.runner.lora.remove(self._next_slot)
                raise
        self.adapters[adapter.name] = self._next_slot
        self.adapter_paths[adapter.name] = adapter.path
        self._next_slot += 1

    def _place(self, manifest: dict[str, Any], spec: ModelSpec) -> Placement:
        """Rank 0's placement (runtime/placement.py): its device, and the KV pool every
        rank shares, from the target and this machine's memory."""
        device = manifest["target"]["device"]
        weights = manifest["files"][fmt.weights_file(0)]["bytes"]
        per_token = KVCache.bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_dtype, spec.v_head_dim
        )
        demand = KVDemand(per_token, spec.page_size, self.context_length * self.max_running)
        memory = gpu_memory(0) if device == "cuda" else available_ram()
        return place(
            device,
            0,
            demand,
            weights,
            memory,
            self.args.max_total_tokens,
            self.args.mem_fraction_static,
        )

    # -- offline API --------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
        return_hidden_states: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts).
        With return_logprob, `logprob_start_len` >= 0 reports the prompt's logprobs from
        that position on too (SGLang's input_token_logprobs; -1: the output's only), and
        `token_ids_logprob` those tokens' logprobs at every reported position.
        `return_hidden_states` (an --enable-return-hidden-states artefact): SGLang's
        meta_info hidden_states, the prompt's rows then one a generated token but the last.
        `lora_path`: the LoRA adapter (by name) of all prompts, or one per prompt."""
        if self.art.spec.is_embedding:
            raise RequestError(f"{self.art.root} is an embedding model (--is-embedding): embed()")
        single, ids_list = self._prompts(prompt, input_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise RequestError(
                    f"{len(sampling_params)} sampling_params for {len(ids_list)} prompts"
                )
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        top = top_logprobs_num if return_logprob else None
        scored = top if logprob_start_len >= 0 else None
        named = tuple(token_ids_logprob or ()) if return_logprob else ()
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(ids_list)
        if len(loras) != len(ids_list):
            raise RequestError(f"{len(loras)} lora_path values for {len(ids_list)} prompts")
        requests = [
            self.make_request(
                list(ids),
                p,
                index=i,
                top_logprobs=top,
                prompt_top_logprobs=scored,
                logprob_ids=named,
                return_hidden_states=return_hidden_states,
                lora=lora,
            )
            for ids, p, lora in zip(ids_list, params, loras, strict=True)
            for i in range(p.n)
        ]
        self._run(requests)
        text = self._token_text if return_text_in_logprobs else None
        results = [self.result(r, logprob_start_len, text) for r in requests]
        return results[0] if single and len(results) == 1 else results

    def embed(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        dimensions: int | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """An embedding model's vectors (SGLang's Engine.encode; kiln's `encode` is the
        tokenizer's): for one prompt a dict, for a batch a list, each {"embedding": the
        last token's final hidden state over its L2 norm, "meta_info": {"id",
        "prompt_tokens", "cached_tokens"}}. `dimensions` (a Matryoshka model): the first
        that many features of the hidden state, over their norm."""
        if not self.art.spec.is_embedding:
            raise RequestError(f"{self.art.root} generates text; embed() needs --is-embedding")
        single, ids_list = self._prompts(prompt, input_ids)
        requests = [self.make_request(list(ids), EMBED, dimensions=dimensions) for ids in ids_list]
        self._run(requests)
        results = [self.embedding_result(r) for r in requests]
        return results[0] if single and len(results) == 1 else results

    @staticmethod
    def embedding_result(req: Request) -> dict[str, Any]:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "cached_tokens": req.cached_tokens,
        }
        return {"embedding": req.embedding, "meta_info": meta}

    def _prompts(
        self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
    ) -> tuple[bool, list[list[int]]]:
        """(one prompt or a batch, each prompt's ids) of the offline API's arguments."""
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (
            input_ids is not None and (not input_ids or isinstance(input_ids[0], int))
        )
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            return single, [self.encode(p) for p in prompts]
        return single, [input_ids] if single else list(input_ids)  # type: ignore[list-item, arg-type]

    def _run(self, requests: list[Request]) -> None:
        """Add `requests` and step until they are all done (the offline API)."""
        for req in requests:
            self.add_request(req)
        while any(not r.finished for r in requests):
            self.step()
        self.release_memory(math.inf)

    # -- the stepping interface -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this server has no tokenizer: send input_ids instead of text")
        return list(self.tokenizer.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call where the tokenizer has one (kiln's reader of
        fast tokenizers: 64 prompts of 1,250 characters 24 -> 13 ms on 2 cores)."""
        batch = getattr(self.tokenizer, "encode_batch", None)
        if batch is None:
            return [self.encode(t) for t in texts]
        return [list(ids) for ids in batch(texts)]

    def make_request(
        self,
        ids: list[int],
        params: SamplingParams,
        index: int = 0,
        top_logprobs: int | None = None,
        priority: int = 0,
        rid: str | None = None,
        prompt_top_logprobs: int | None = None,
        logprob_ids: tuple[int, ...] = (),
        dimensions: int | None = None,
        return_hidden_states: bool = False,
        lora: str | None = None,
    ) -> Request:
        """A validated request (not yet queued). `prompt_top_logprobs`: the prompt's
        logprobs too (with the top k of each), its prompt computed whole (no prefix-cache
        hit); with max_new_tokens 0 it only scores its prompt. `logprob_ids`: with logprobs,
        these tokens' at each position too (at most MAX_LOGPROB_IDS). `dimensions`: a
        Matryoshka embedding model's request, its vector cut to that many features.
        `return_hidden_states`: its final hidden states, kept as its steps run (its prompt
        computed whole: a cached prefix has none). `lora`: a loaded LoRA adapter's name."""
        if not ids:
            raise RequestError("the prompt is empty")
        adapter = self.adapter_slot(lora)
        if return_hidden_states and not self.art.spec.return_hidden_states:
            raise RequestError(
                "return_hidden_states: this model was compiled without "
                "--enable-return-hidden-states"
            )
        if dimensions is not None:
            self.check_dimensions(dimensions)
        self.check_vocabulary(ids, "token ids")
        self.check_vocabulary([t for t, _ in params.logit_bias], "logit_bias names tokens")
        if logprob_ids:
            self.check_vocabulary(logprob_ids, "token_ids_logprob names tokens")
            if len(logprob_ids) > MAX_LOGPROB_IDS:
                raise RequestError(
                    f"token_ids_logprob names {len(logprob_ids)} tokens; at most {MAX_LOGPROB_IDS}"
                )
            if top_logprobs is None:
                raise RequestError("token_ids_logprob needs return_logprob")
        if len(ids) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        constraint = params.constraint
        if constraint is not None and self.grammars is None:  # compiled by attach_grammar
            raise self._grammars_off(constraint.kind)
        gen = None
        if params.sampling_seed is not None:
            # Modulo 2**64: any seed the parameters accept, plus the index, is a valid state.
            gen = new_generator((params.sampling_seed + index) % 2**64)
        elif self._rng is not None:
            gen = new_generator(int(self._rng.integers(2**62)))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.skip_special_tokens, params.no_stop_trim
            )
        elif params.stop:
            raise RequestError("stop strings need a tokenizer; this server has none")
        return Request(
            rid or uuid.uuid4().hex,
            ids,
            params,
            generator=gen,
            top_logprobs=top_logprobs,
            logprob_ids=logprob_ids,
            detok=detok,
            priority=priority,
            prompt_top_logprobs=prompt_top_logprobs,
            dimensions=dimensions,
            return_hidden_states=return_hidden_states,
            lora=lora,
            adapter=adapter,
        )

    def load_adapter(self, adapter: Adapter) -> None:
        """Serve `adapter` (read and checked off the engine thread: runtime/lora.py
        read_adapter) from the next step on; on the engine thread, between steps."""
        from kiln.runtime.lora import LoraError

        if not self.args.enable_lora or self.runner.lora is None:
            raise RequestError("loading a LoRA adapter needs --enable-lora")
        if adapter.name in self.adapters:
            raise RequestError(f"LoRA adapter {adapter.name!r} is already loaded")
        most = self.args.max_loaded_loras
        if most is not None and len(self.adapters) >= most:
            raise RequestError(f"{len(self.adapters)} LoRA adapters are loaded: --max-loaded-loras")
        try:
            self._add_adapter(adapter)
        except LoraError as e:
            raise RequestError(str(e)) from None
        log.info("LoRA adapter %r loaded from %s", adapter.name, adapter.path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`: new requests for it are refused now, its weights go
        once the requests that hold it have ended (on the engine thread)."""
        slot = self.adapters.pop(name, None)
        if slot is None:
            raise RequestError(f"no LoRA adapter {name!r} is loaded")
        self.adapter_paths.pop(name, None)
        self._retiring.add(slot)
        self._free_retired()
        log.info("LoRA adapter %r unloaded", name)

    def _free_retired(self) -> None:
        held = {r.adapter for r in self._live.values()}
        for slot in self._retiring - held:
            assert self.runner.lora is not None
            self.runner.lora.remove(slot)
            if not self._tell_ranks({"lora": "remove", "slot": slot}):
                # the slot is never used again: only its memory stays
                log.error("LoRA: a tensor-parallel rank could not drop slot %d", slot)
            self._retiring.discard(slot)

    def adapter_slot(self, name: str | None) -> int:
        """The runner's slot of LoRA adapter `name` (0: None, the base model)."""
        if name is None:
            return 0
        if not self.args.enable_lora:
            raise RequestError(f"lora_path {name!r}: this server runs without --enable-lora")
        slot = self.adapters.get(name)
        if slot is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise RequestError(f"lora_path: no LoRA adapter {name!r} is loaded (loaded: {loaded})")
        return slot

    def check_dimensions(self, dimensions: int) -> None:
        """RequestError unless an embedding of `dimensions` features is one this model
        gives: a Matryoshka model's (config.json's is_matryoshka or matryoshka_dimensions),
        cut to at most its width, and to a listed width where it lists some."""
        spec = self.art.spec
        if not spec.matryoshka:
            raise RequestError(
                "dimensions: this model was not trained for Matryoshka truncation (its "
                "config sets neither is_matryoshka nor matryoshka_dimensions; compile with "
                "--json-model-override-args '{\"is_matryoshka\": true}' if it was)"
            )
        width = spec.embedding_dim or 0
        if isinstance(dimensions, bool) or not 1 <= dimensions <= width:
            raise RequestError(f"dimensions must be in [1, {width}], got {dimensions}")
        listed = spec.matryoshka_dimensions
        if listed and dimensions not in listed:
            raise RequestError(
                f"dimensions {dimensions}: this model was trained for {list(listed)} only"
            )

    def check_vocabulary(self, ids: Iterable[int], what: str) -> None:
        """RequestError naming `what` and the first ids outside the model's vocabulary."""
        vocab = self.art.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{what} outside the vocabulary [0, {vocab}): {bad[:5]}")

    def attach_grammar(self, req: Request) -> None:
        """Compile the request's constraint (cached) and give it its own matcher. Slow for
        a big grammar: the server runs it on its grammar threads, never on the engine
        thread; GrammarError (a ValueError) names the field when it does not compile."""
        constraint = req.params.constraint
        if constraint is None or req.grammar is not None:
            return
        if self.grammars is None:
            raise self._grammars_off(constraint.kind)
        req.grammar = self.grammars.matcher(self.grammars.compile(constraint))

    def _grammars_off(self, kind: str) -> RequestError:
        why = "no tokenizer" if self.tokenizer is None else "--grammar-backend none"
        return RequestError(f"{kind}: grammar-constrained decoding is off ({why})")

    def add_request(self, req: Request) -> None:
        if req.rid in self._live:
            raise RequestError(f"rid {req.rid!r} is already in use by a request in flight")
        if req.lora is not None and self.adapters.get(req.lora) != req.adapter:
            # its adapter was unloaded between the request's making and now
            gone = f"LoRA adapter {req.lora!r} was unloaded"
            self._finish(req, {"type": "abort", "message": gone, "status_code": 400})
            return
        self.attach_grammar(req)  # the offline API's requests; served ones have theirs
        if not req.scores_only and self._finish_if_done(req):
            return
        self.scheduler.add(req)
        self._live[req.rid] = req

    def abort(self, rid: str, reason: dict[str, Any] | None = None) -> RequestOutput | None:
        """Stop a request now and free its memory; None if it is not running or queued.
        `reason` (default: a plain abort) is what its finish_reason reports; one with a
        `status_code` is a failure the server reports as an HTTP error."""
        req = self._live.get(rid)
        if req is None:
            return None
        self._finish(req, reason or {"type": "abort", "message": "aborted"})
        return self.output(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def start_profile(self, path: Path, num_steps: int | None = None, start_step: int = 0) -> None:
        """Record the next steps into a trace at `path` (runtime/profiler.py; written when
        `num_steps` steps are in, or at stop_profile). RequestError if one is recording."""
        from kiln.runtime.native_step import NativeStep
        from kiln.runtime.profiler import StepProfile

        if self.profile is not None and not self.profile.done:
            raise RequestError("a profile is already being recorded (/stop_profile ends it)")
        native = self.runner.decode if isinstance(self.runner.decode, NativeStep) else None
        self.profile = StepProfile(self.art, native, path, num_steps, start_step)

    def stop_profile(self) -> Path | None:
        """End the profile being recorded and write its trace; returns its path (None:
        none was recording)."""
        profile, self.profile = self.profile, None
        if profile is None or profile.done:
            return None
        profile.finish()
        return profile.path

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run, postprocess. Returns what each request gained."""
        profile = self.profile
        started = profile.step_started() if profile is not None else 0
        outputs, batch = self._step()
        if profile is not None and batch is not None:
            profile.step_done(started, batch)
            if profile.done:
                self.profile = None
        return outputs

    def _step(self) -> tuple[list[RequestOutput], Batch | None]:
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.waiting and not self.scheduler.holding:
                raise MemoryError(
                    "the KV pool cannot fit the next waiting request; raise --max-total-tokens"
                )
            return [], None
        if self._may_speculate(batch):
            self._draft(batch)
        failed = dict(self._execute(batch))
        for req, error in failed.items():
            log.error("request %s failed and was stopped: %s", req.rid, error)
            # a lost rank (or --crash-on-nan) takes the server down, not this request: 503
            # and why
            lost = isinstance(error, RankLost | NanLogits)
            message = str(error) if lost else f"internal error: {error}"
            self._finish(
                req, {"type": "abort", "message": message, "status_code": 503 if lost else 500}
            )
        now = time.perf_counter()
        outputs = []
        for req, sampled in zip(batch.requests, batch.sample, strict=True):
            if req in failed:
                outputs.append(self.output(req))
            elif req.scores_only and not req.scoring:  # its prompt is scored: done
                self._finish(req, {"type": "length", "length": 0})
                outputs.append(self.output(req))
            elif req.embedding is not None:  # an embedding model's prompt is in: done
                self._finish(req, {"type": "stop", "matched": None})
                outputs.append(self.output(req))
            elif sampled:
                if req.first_token_at is None:
                    req.first_token_at = now
                if not batch.verify:  # a verify step postprocessed each token it kept
                    self._postprocess(req)
                outputs.append(self.output(req))
        self.batch_log.after(batch, outputs)
        if self._retiring:
            self._free_retired()
        return outputs, batch

    def _may_speculate(self, batch: Batch) -> bool:
        """A decode batch of at most max_batch requests of a speculative artefact: the
        steps that may verify drafts."""
        spec = self.speculative
        return spec is not None and not batch.is_prefill and len(batch.requests) <= spec.max_batch

    def _draft(self, batch: Batch) -> None:
        """Drafted tokens for the requests of a decode batch, making it a verify batch
        when any has some (runtime/speculative.py); not past a request's max_new_tokens
        or the context."""
        spec, costs = self.speculative, self.step_costs
        assert spec is not None and costs is not None
        if self.draft_model is not None:
            self._draft_with_model(batch)
            return
        reqs = batch.requests
        offered = []
        for req in reqs:
            room = min(spec.max_drafts, self._room(req))
            if req.drafter is None:
                req.drafter = drafter(spec)
            offered.append(req.drafter.propose(req.all_ids, room) if room > 0 else [])
        if not any(offered):
            return
        alphas = [acceptance(r.spec_drafted, r.spec_accepted) for r in reqs]
        counts = plan_drafts(alphas, [len(d) for d in offered], [r.kv_len for r in reqs], costs)
        self._attach(batch, [d[:k] for d, k in zip(offered, counts, strict=True)])

    def _attach(self, batch: Batch, drafts: list[list[int]]) -> None:
        """Each request's drafts fed after its last token, where the pool has pages for
        them: the batch becomes a verify batch if any request has some."""
        for i, (req, mine) in enumerate(zip(batch.requests, drafts, strict=True)):
            if mine and self.scheduler.grow(req, len(mine)):
                batch.new_tokens[i] = batch.new_tokens[i] + mine
                batch.verify = True

    def _room(self, req: Request) -> int:
        """Drafts worth verifying for `req`: not past its max_new_tokens or the context."""
        return min(
            req.params.max_new_tokens - len(req.output_ids) - 1,
            self.context_length - req.num_tokens - 1,
        )

    def _draft_with_model(self, batch: Batch) -> None:
        """STANDALONE: as many draft-model steps as the planner finds pay, for the whole
        batch; each request verifies the drafts it has room for."""
        spec, draft = self.speculative, self.draft_model
        assert spec is not None and spec.num_steps and draft is not None
        assert self.step_costs is not None and self.draft_costs is not None
        reqs = batch.requests
        rooms = [self._room(r) for r in reqs]
        most = min(spec.num_steps, max(rooms))
        if most <= 0:
            return
        record = self.draft_record
        alphas = [acceptance(r.spec_drafted, r.spec_accepted, record.prior) for r in reqs]
        kv_lens = [r.kv_len for r in reqs]
        k = plan_steps(alphas, kv_lens, most, self.step_costs, self.draft_costs)
        if k == 0 and record.exploring:  # (its acceptance not known yet: find it out)
            k = 1
        if k == 0:
            return
        proposed = draft.propose(reqs, k)
        self._attach(batch, [d[: max(0, room)] for d, room in zip(proposed, rooms, strict=True)])
        if not batch.verify:  # (no pages for any request's drafts) a plain decode step:
            for req in reqs:  # what the draft drafted past the model's tokens goes now
                draft.settle(req)

    def _execute(self, batch: Batch) -> list[tuple[Request, Exception]]:
        """Forward, sample and commit `batch`. If that fails, run each half of it on its
        own, and so on down: a request whose inputs or parameters break a kernel or the
        sampler is the only one lost. Returns the requests that failed alone."""
        # Requests mid-way through a chunked prompt feed tokens but sample nothing yet.
        sampling = [r for r, s in zip(batch.requests, batch.sample, strict=True) if s]
        try:
            start = time.perf_counter()
            # (an EAGLE head's input: where each request's kept rows begin)
            eagle = isinstance(self.draft_model, EagleDraft)
            before = [r.kv_len for r in batch.requests] if eagle else []
            logits = self.runner.forward(batch)
            costs = self.step_costs
            # What a decode step of a row count the planner knows cost (a bigger batch's
            # rows are past its table, and are not summed up for nothing each step).
            if costs is not None and not batch.is_prefill and len(batch.requests) < costs.size:
                fed = [len(f) for f in batch.new_tokens]
                kv = sum(rows_kv(r.kv_len, n) for r, n in zip(batch.requests, fed, strict=True))
                costs.observe(sum(fed), kv, time.perf_counter() - start)
            if self.nan_detection:
                logits = self._without_nan(logits, batch)
            if self.art.spec.return_hidden_states:
                self._keep_hidden_states(batch)
            if batch.verify:
                failed = self._accept(batch, logits)
                self._keep_for_head(batch, before)
                return failed
            if self.art.spec.is_embedding:
                scores_only = bool(self.art.spec.labels)  # a classifier's logits, as they are
                for req, row in zip(sampling, host_rows(logits), strict=True):
                    req.embedding = (
                        row.astype(np.float64).tolist()
                        if scores_only
                        else _normalised(row[: req.dimensions])
                    )
                self.scheduler.commit(batch, None)
                return []
            scores: list[tuple[Request, list[TokenLogprob]]] = []
            if any(batch.scored):
                logits, scores = self._score_prompts(batch, logits)
            rows = [self._sampling_row(r) for r in sampling]
            tokens, logprobs = sample(logits, rows) if rows else ([], [])
        except NanLogits as e:  # no retry: the weights or the kernels are broken
            if self._on_fatal is not None:
                self._on_fatal(str(e))
            return [(r, e) for r in batch.requests]
        except Exception as e:
            group = self.runner.group
            lost = group.lost_rank(e) if group is not None else None
            if lost is not None:  # a collective failed because a rank died: no retry helps
                return [(r, RankLost(lost)) for r in batch.requests]
            if len(batch.requests) == 1:
                return [(batch.requests[0], e)]
            log.warning("a batch of %d failed (%s); retrying it in halves", len(batch.requests), e)
            mid = len(batch.requests) // 2
            return self._execute(batch.subset(0, mid)) + self._execute(batch.subset(mid, None))
        self.scheduler.commit(batch, tokens)
        self._keep_for_head(batch, before)
        for req, lp in zip(sampling, logprobs, strict=True):
            if lp is not None:
                req.logprobs.append(lp)
        for req, lps in scores:
            req.prompt_logprobs += lps
        return []

    def _keep_for_head(self, batch: Batch, before: list[int]) -> None:
        """An EAGLE head's input: the model's hidden states (every fed row's: the step's
        second output) of the positions each request kept, from its KV length `before`
        the step to its KV length now."""
        head = self.draft_model
        if not isinstance(head, EagleDraft) or not before:
            return
        rows, at = host_rows(self.runner.hidden), 0
        for req, fed, first in zip(batch.requests, batch.new_tokens, before, strict=True):
            if not req.finished and req.kv_len > first:
                head.keep(req, first, rows[at : at + req.kv_len - first])
            at += len(fed)

    def _keep_hidden_states(self, batch: Batch) -> None:
        """The step's final hidden states (one row per logits row, runtime/model_runner.py)
        of the requests that asked for them, by position: a row at a position a request
        already holds (a retracted request fed again) is not added twice."""
        hidden, at = self.runner.hidden, 0
        for req, fed, count in zip(batch.requests, batch.new_tokens, batch.rows(), strict=True):
            if req.return_hidden_states and count:
                rows = host_rows(hidden[at : at + count])
                first = req.kv_len + len(fed) - count  # the position of the first row
                if first > len(req.hidden_states):  # its rows are computed in order
                    raise RuntimeError(f"hidden states from position {first} would leave a gap")
                for j in range(len(req.hidden_states) - first, count):
                    req.hidden_states.append(rows[j].tolist())
            at += count

    def _without_nan(self, logits: Logits, batch: Batch) -> Logits:
        """`logits` with NaN read as -1e5 (SGLang's value: never sampled, no inf to upset a
        softmax), the batch's requests named in a warning; NanLogits with --crash-on-nan."""
        if isinstance(logits, np.ndarray):
            bad = np.isnan(logits).any(axis=-1).reshape(-1)
        else:
            bad = torch.isnan(logits).any(dim=-1).reshape(-1).cpu().numpy()
        if not bad.any():
            return logits
        rids = ", ".join(r.rid for r in batch.requests[:8])
        more = f" and {len(batch.requests) - 8} more" if len(batch.requests) > 8 else ""
        what = f"NaN in the logits of {int(bad.sum())} of {bad.size} rows (batch: {rids}{more})"
        if self.crash_on_nan:
            raise NanLogits(f"{what}; the server stops (--crash-on-nan)")
        log.warning("%s; NaN read as -1e5 (--enable-nan-detection)", what)
        if isinstance(logits, np.ndarray):
            return np.where(np.isnan(logits), np.float32(-1e5), logits)
        return torch.nan_to_num(logits, nan=-1e5)

    def on_fatal(self, fn: Callable[[str], None]) -> None:
        """Have `fn(reason)` called when the engine cannot go on (--crash-on-nan)."""
        self._on_fatal = fn

    def _score_prompts(
        self, batch: Batch, logits: Logits
    ) -> tuple[Logits, list[tuple[Request, list[TokenLogprob]]]]:
        """A batch with scored requests (`Batch.scored`): the logits rows that sample, and
        the prompt logprobs each scored request's rows give. The row after prompt token j
        gives token j + 1's; rows of tokens already scored (a retracted request fed again)
        or after the prompt's last give none."""
        keep: list[int] = []
        scores: list[tuple[Request, list[TokenLogprob]]] = []
        at = 0
        for i, (req, count) in enumerate(zip(batch.requests, batch.rows(), strict=True)):
            # (a request scored for its hidden states alone wants no prompt logprobs)
            if batch.scored[i] and req.prompt_top_logprobs is not None:
                first = len(req.prompt_logprobs)  # the next position to score
                if req.kv_len > first:  # a scored prompt is fed whole
                    raise RuntimeError("the prompt's logprobs would skip cached tokens")
                end = min(req.kv_len + count, len(req.prompt_ids) - 1)
                if first < end:
                    rows = logits[at + first - req.kv_len : at + end - req.kv_len]
                    targets = req.prompt_ids[first + 1 : end + 1]
                    assert req.prompt_top_logprobs is not None
                    lps = token_logprobs(rows, targets, req.prompt_top_logprobs, req.logprob_ids)
                    scores.append((req, lps))
            if batch.sample[i]:
                keep.append(at + count - 1)
            at += count
        return logits[keep], scores

    def _accept(self, batch: Batch, logits: Logits) -> list[tuple[Request, Exception]]:
        """A verify step's tokens: each request's rows sampled in order as decoding would
        sample them, each kept token committed and postprocessed, up to and including the
        first that differs from its draft (runtime/speculative.py). A request whose rows
        break the sampler fails alone."""
        failed: list[tuple[Request, Exception]] = []
        at = 0
        for req, fed in zip(batch.requests, batch.new_tokens, strict=True):
            rows = logits[at : at + len(fed)]
            at += len(fed)
            try:
                self._accept_rows(req, fed, rows)
            except Exception as e:
                failed.append((req, e))
        return failed

    def _accept_rows(self, req: Request, fed: list[int], logits: Logits) -> None:
        # Rows a greedy request without penalties, grammar or logprobs would sample to
        # their argmax all at once: the sampler's own choice for each (a plain row stays
        # plain as tokens are kept: nothing is suppressed once nothing was).
        argmax = argmax_rows(logits) if self._sampling_row(req).plain else None
        kept = 0
        for j in range(len(fed)):
            if argmax is not None:
                token, lp = argmax[j], None
            else:
                tokens, lps = sample(logits[j : j + 1], [self._sampling_row(req)])
                token, lp = tokens[0], lps[0]
            req.kv_len += 1  # fed[j] is an accepted token: its K/V stay
            req.output_ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            self._postprocess(req)
            if req.finished or j + 1 == len(fed) or token != fed[j + 1]:
                break
            req.spec_accepted += 1
            kept += 1
        if len(fed) > 1:
            req.spec_verify_ct += 1
            req.spec_drafted += len(fed) - 1
            self.draft_record.add(len(fed) - 1, kept)
        if not req.finished:
            self.scheduler.trim(req)
            if self.draft_model is not None:
                self.draft_model.settle(req)

    def _sampling_row(self, req: Request) -> SamplingRow:
        if req.sampling_row is not None:
            return req.sampling_row
        p = req.params
        suppress: tuple[int, ...] = ()
        if len(req.output_ids) < p.min_new_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self._eos)
            suppress = tuple(t for t in sorted(stops) if 0 <= t < self.art.spec.vocab_size)
        row = SamplingRow(
            p,
            req.generator,
            req.prompt_ids,
            req.output_ids,
            req.top_logprobs,
            suppress,
            req.grammar,
            req.logprob_ids,
        )
        if not suppress:  # nothing will be suppressed again: the row is final
            req.sampling_row = row
        return row

    def _postprocess(self, req: Request) -> None:
        """Advance the request's grammar, detokenize the new token and decide whether the
        request is done."""
        token = req.output_ids[-1]
        if req.grammar is not None and not req.grammar.is_terminated():
            req.grammar.accept_token(token)
        if req.detok is not None and (
            not self._is_stop_token(req, token) or req.params.no_stop_trim
        ):
            req.detok.push(token)
        self._finish_if_done(req)

    def _is_stop_token(self, req: Request, token: int) -> bool:
        p = req.params
        return (token in self._eos and not p.ignore_eos) or token in p.stop_token_ids

    def _finish_if_done(self, req: Request) -> bool:
        p = req.params
        reason: dict[str, Any] | None = None
        if req.output_ids:
            last = req.output_ids[-1]
            if self._is_stop_token(req, last):
                reason = {"type": "stop", "matched": last}
            elif req.detok is not None and req.detok.matched is not None:
                reason = {"type": "stop", "matched": req.detok.matched}
            elif req.grammar is not None and req.grammar.is_terminated():
                reason = {"type": "stop", "matched": None}  # the grammar ended
        if reason is None and (
            len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= self.context_length
        ):
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is None:
            return False
        self._finish(req, reason)
        return True

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        self.scheduler.finish(req, reason)
        self._live.pop(req.rid, None)
        if req.detok is not None:
            req.detok.flush()
        if self.args.enable_request_time_stats_logging:
            self._log_time_stats(req)

    def _log_time_stats(self, req: Request) -> None:
        """SGLang's --enable-request-time-stats-logging line: the time a request waited for
        its first step and the time from there to its end."""
        now = time.perf_counter()
        start = req.started_at if req.started_at is not None else now  # never ran
        log.info(
            "Req Time Stats(rid=%s, input len=%d, output len=%d, type=unified): "
            "queue_duration=%.2fms, forward_duration=%.2fms, start_time=%.3f",
            req.rid,
            len(req.prompt_ids),
            len(req.output_ids),
            (start - req.created) * 1e3,
            (now - start) * 1e3,
            time.time() - (now - req.created),
        )

    # -- reporting ----------------------------------------------------------------------------
    def output(self, req: Request) -> RequestOutput:
        new = req.output_ids[req.reported :]
        lps = req.logprobs[req.reported :] if req.top_logprobs is not None else []
        req.reported = len(req.output_ids)
        text = req.detok.take(final=req.finished) if req.detok is not None else ""
        prompt_lps = None
        if req.prompt_top_logprobs is not None and not req.prompt_reported:
            prompt_lps, req.prompt_reported = list(req.prompt_logprobs), True
        return RequestOutput(
            req.rid,
            new,
            text,
            lps,
            req.finished,
            req.finish_reason,
            len(req.prompt_ids),
            len(req.output_ids),
            req.cached_tokens,
            self._spec_meta(req) if self.speculative is not None else None,
            prompt_lps,
            req.embedding,
            req.hidden_states if req.return_hidden_states and req.finished else None,
        )

    @staticmethod
    def _spec_meta(req: Request) -> dict[str, Any]:
        """SGLang's speculative meta_info names. Only steps where the request had drafts
        count as verify steps; accept length is the tokens each of them landed."""
        verify, drafted, kept = req.spec_verify_ct, req.spec_drafted, req.spec_accepted
        return {
            "spec_verify_ct": verify,
            "spec_draft_token_num": drafted,
            "spec_accept_token_num": kept,
            "spec_accept_rate": kept / drafted if drafted else 0.0,
            "spec_accept_length": 1 + kept / verify if verify else 0.0,
        }

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.decode([token]))

    def result(
        self,
        req: Request,
        logprob_start_len: int = -1,
        text: Callable[[int], str | None] | None = None,
    ) -> dict[str, Any]:
        """SGLang's result shape for a finished request; `text`, each logprob entry's token
        text (return_text_in_logprobs), else None."""
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason,
            "e2e_latency": time.perf_counter() - req.created,
        }
        if self.speculative is not None:
            meta.update(self._spec_meta(req))
        if req.return_hidden_states:
            meta["hidden_states"] = hidden_meta(len(req.prompt_ids), req.hidden_states)
        if req.top_logprobs is not None:
            meta.update(
                logprob_meta(
                    req.logprobs,
                    bool(req.logprob_ids),
                    text,
                    req.prompt_ids,
                    req.prompt_logprobs if req.prompt_top_logprobs is not None else None,
                    logprob_start_len,
                )
            )
        return {
            "text": req.detok.text if req.detok is not None else "",
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    def prompt_logits(
        self, input_ids: list[int], chunk: int | None = None, lora: str | None = None
    ) -> torch.Tensor:
        """Logits after every token of `input_ids` ([len, vocab], float32), outside the
        scheduler (for scoring text: perplexity, quality gates): one prefill, or steps of
        `chunk` tokens, each attending to the earlier ones through the KV pool as decoding
        does (chunk=1 is decoding; what an fp8 --kv-cache-dtype changes); through LoRA
        adapter `lora` when given."""
        adapter = self.adapter_slot(lora)
        if not input_ids or len(input_ids) > self.runner.pool.free_tokens:
            raise RequestError(
                f"prompt_logits: {len(input_ids)} tokens; 1 to {self.runner.pool.free_tokens}"
            )
        step = chunk or len(input_ids)
        req = Request("score", list(input_ids), SamplingParams(), lora=lora, adapter=adapter)
        req.pages = self.runner.pool.allocate(self.runner.pool.pages_for(len(input_ids)))
        try:
            out = []
            for start in range(0, len(input_ids), step):
                fed = list(input_ids[start : start + step])
                batch = Batch([req], [fed], [True], is_prefill=len(fed) > 1)
                out.append(self.runner.forward(batch, all_logits=True))
                req.kv_len += len(fed)
            return as_tensor(out[0]) if len(out) == 1 else torch.cat([as_tensor(o) for o in out])
        finally:
            self.runner.pool.free(req.pages)

    def update_weights(self, root: Path) -> int:
        """Serve the weights of artefact `root`, compiled from another checkpoint with this
        artefact's arguments (runtime/weight_update.py): checked on every rank, then copied
        into place on every rank; the prefix cache's entries (K/V of the old weights) are
        dropped. The server calls it with no request running, unless generation is paused
        (SGLang's trainer rounds): those running then are retracted, their K/V being the
        old weights', and prefilled again (prompt and output so far) with the new ones, so
        no K/V of the old weights is ever read again. Returns the cached tokens dropped;
        WeightUpdateError says why nothing changed."""
        from kiln.runtime.weight_update import WeightUpdateError, apply_update, read_update

        new = read_update(self.art, Path(root), 0)
        if not self._tell_ranks({"weights": "check", "path": str(root)}):
            self._tell_ranks({"weights": "drop"})
            raise WeightUpdateError(
                "a tensor-parallel rank could not read the new weights (its log says why)"
            )
        for req in reversed(list(self.scheduler.running)):  # each back to the front, in order
            self.scheduler.retract(req)
        apply_update(self.runner, new)
        if not self._tell_ranks({"weights": "load"}):  # checked: only a broken rank fails
            raise RuntimeError("a tensor-parallel rank failed to copy weights it had checked")
        log.warning("weights updated from %s", root)
        if self.kv_store is not None:  # the disk tier's blocks are the old weights'
            self.kv_store.rebind(checked_manifest(Path(root), verify=False)["files"])
        return self.flush_cache()

    def flush_cache(self) -> int:
        """Drop every prefix-cache entry no request is using; returns tokens freed. Their
        memory goes back to the OS."""
        freed = self.scheduler.flush_cache() * self.runner.pool.page_size
        self.release_memory()
        return freed

    def release_memory(self, budget_s: float = RELEASE_BUDGET_S) -> int:
        """Give the OS back the KV memory of pages freed since the last call (no request
        or prefix-cache entry holds them); returns the bytes. Called when the engine goes
        idle, and after a flush; a fragmented pool is worked through `budget_s` seconds a
        call, so a request arriving meanwhile waits at most that. On a tensor-parallel
        artefact, rank 0's pool only."""
        pool = self.runner.pool
        released, rest = self.runner.kv.release(pool.take_freed(), pool.page_size, budget_s)
        pool.put_back_freed(rest)
        return released

    def on_rank_failure(self, fn: Callable[[str], None]) -> None:
        """Have `fn(reason)` called, from another thread, when a tensor-parallel rank dies
        (at once if one already has); nothing happens for a one-process engine."""
        group = self.runner.group
        if group is None:
            return
        group.on_failure = fn
        if group.failure is not None:
            fn(group.failure)

    def shutdown(self) -> None:
        """Release the KV pool and weights, and stop the other tensor-parallel ranks (the
        engine is unusable afterwards)."""
        group = self.runner.group
        if self.kv_store is not None:
            self.kv_store.close()  # the pages on the way are written first
        del self.runner
        if group is not None:
            group.close()

    def _start_ranks(self, kv_tokens: int) -> None:
        """Ranks 1..T-1 of a tensor-parallel artefact (those of node 0 with --nnodes), each
        with its share of this machine's threads."""
        size, nnodes = self.art.spec.tp_size, self.args.nnodes
        if self.numa_threads and not self.args.threads:  # each rank its node's share
            per_rank = self.numa_threads
        else:
            per_rank = [max(1, self.threads // (size // nnodes))] * (size // nnodes)
        set_threads(per_rank[0])
        self.threads = per_rank[0]
        self.runner.group = TPGroup(
            self.art.root,
            size,
            kv_tokens,
            per_rank[1:],
            self.args.dist_init_addr,
            self.args.dist_timeout,
            nnodes,
            self.placement,
            self.context_length,
            self.args.trust_remote_code,
            self.numa[1:] if self.numa else None,
            mapped=not self.args.weight_loader_disable_mmap,
        )
        if self.runner.lora is not None:  # the other ranks hold the same adapters
            from kiln.runtime.lora import LoraError

            targets = self.args.lora_target_modules
            try:
                if not self._tell_ranks({"lora": "enable", "targets": targets and list(targets)}):
                    raise LoraError("a tensor-parallel rank could not serve adapters")
                for name, slot in self.adapters.items():
                    self._share_adapter(slot, name, self.adapter_paths[name])
            except LoraError as e:
                self.runner.group.close()
                self.runner.group = None
                raise ArgError(f"--enable-lora: {e}") from None

    def _tell_ranks(self, message: dict[str, Any]) -> bool:
        """A control message to the other tensor-parallel ranks (runtime/rank_worker.py):
        True when each did what it asks (or there are none)."""
        group = self.runner.group
        return group is None or group.control(message)

    def _share_adapter(self, slot: int, name: str, path: str) -> None:
        """Adapter `name` into `slot` of every other rank, or of none: LoraError. Each rank
        reads the folder itself (on another node, the same path there)."""
        from kiln.runtime.lora import LoraError

        add = {"lora": "add", "slot": slot, "name": name, "path": path}
        if not self._tell_ranks({**add, "max_rank": self.args.max_lora_rank}):
            self._tell_ranks({"lora": "remove", "slot": slot})  # from the ranks that have it
            raise LoraError(
                f"LoRA adapter {name!r}: a tensor-parallel rank could not load it from "
                f"{path} (that rank's log says why)"
            )


def _set_threads(
    asked: int | None, numa_nodes: list[int] | None = None, shares: list[int] | None = None
) -> tuple[int, str]:
    """Apply --threads; return the kernel thread count and where it came from (with
    --numa-node, the node's share of its cores; torch's default otherwise:
    runtime/threads.py, which hands it to torch if torch comes)."""
    if asked:
        set_threads(asked)
        return asked, "--threads"
    if numa_nodes and shares:
        count = shares[0]
        set_threads(count)
        return count, f"NUMA node {numa_nodes[0]}'s cores"
    count, source = default_threads()
    set_threads(count)
    return count, source


def _normalised(row: np.ndarray) -> list[float]:
    """An embedding: the row over its L2 norm (float64 sums; a zero row stays zero)."""
    v = row.astype(np.float64)
    norm = float(np.sqrt(v @ v))
    return (v / norm if norm > 0 else v).tolist()


def chunked_prefill_for(memory_mib: float | None) -> int:
    """--chunked-prefill-size's default on a device of `memory_mib` (None: unknown)."""
    if memory_mib is None:
        return DEFAULT_CHUNKED_PREFILL
    for below, tokens in CHUNKED_PREFILL_BY_MEMORY:
        if memory_mib < below:
            return tokens
    return LARGEST_CHUNKED_PREFILL


def device_memory_mib(device: str) -> float | None:
    """The memory SGLang sizes its defaults by: a GPU's, or a CPU's smallest NUMA node's
    (the machine's, shared out between its nodes, where sysfs lists none)."""
    if device == "cuda":
        return float(gpu_memory(0) // 2**20)  # the GPU the engine places on (_place)
    if device != "cpu":
        return None
    from kiln.runtime.numa import node_memory_mib, nodes

    sizes = node_memory_mib()
    if sizes:
        return float(min(sizes))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError):
        return None
    return float(total // max(1, len(nodes())))
