"""Prometheus metrics (`--enable-metrics`): latency histograms, request and token counters,
and gauges read from the scheduler at scrape time. Every series carries SGLang's
`model_name` label (the served model name); the per-request ones also carry the labels
`--tokenizer-metrics-allowed-custom-labels` names, which a request sets in the JSON object
of its `--tokenizer-metrics-custom-labels-header` header (SGLang's scheme)."""

from __future__ import annotations

import contextvars
import json
import logging
import re
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.args import ArgError, token_buckets
from kiln.serve.middleware import send_error

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from kiln.runtime.request import RequestOutput
    from kiln.serve.async_engine import AsyncEngine

log = logging.getLogger("kiln.serve")

# Clients choose custom labels' values, and each distinct set is a series every scrape
# returns from then on: a value is at most MAX_LABEL_VALUE characters (longer: a 400), and
# past MAX_LABEL_SETS distinct sets a request's values count as "other" (a warning, once).
MAX_LABEL_VALUE = 128
MAX_LABEL_SETS = 256
LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_LABELS = frozenset({"model_name", "le", "quantile"})
# The custom labels of the request being served (set by CustomLabels for its task).
REQUEST_LABELS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "kiln_request_labels", default=None
)

# Defaults when the --bucket-* flags are not given (seconds).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1, 2, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


def allowed_labels(names: list[str] | None) -> tuple[str, ...]:
    """--tokenizer-metrics-allowed-custom-labels, checked as Prometheus label names."""
    flag = "--tokenizer-metrics-allowed-custom-labels"
    for name in names or ():
        if not LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ArgError(f"{flag}: {name!r} is not a Prometheus label name")
        if name in RESERVED_LABELS:
            raise ArgError(f"{flag}: {name!r} is a label kiln sets itself")
    if len(set(names or ())) != len(names or ()):
        raise ArgError(f"{flag}: a label is named twice")
    return tuple(names or ())


def request_labels(header: str, value: str, allowed: frozenset[str]) -> dict[str, str]:
    """The allowed custom labels a request's header gives (others are dropped, as SGLang
    drops them); ValueError naming the header when it is not a JSON object of short
    string or number values."""
    try:
        given = json.loads(value)
    except ValueError:
        raise ValueError(f"header {header}: not JSON") from None
    if not isinstance(given, dict):
        raise ValueError(f"header {header}: a JSON object of label names to values")
    labels = {}
    for name, v in given.items():
        if name not in allowed:
            continue
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ValueError(f"header {header}: label {name}'s value must be a string or number")
        text = str(v)
        if len(text) > MAX_LABEL_VALUE:
            raise ValueError(
                f"header {header}: label {name}'s value is over {MAX_LABEL_VALUE} characters"
            )
        labels[name] = text
    return labels


class CustomLabels:
    """ASGI middleware: a request's custom metric labels, read from its header, for the
    metrics its outputs record (REQUEST_LABELS); a malformed header is a 400."""

    def __init__(self, app: ASGIApp, header: str, allowed: tuple[str, ...]) -> None:
        self.app, self.header, self.allowed = app, header, frozenset(allowed)
        self._key = header.lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = None
        if scope["type"] == "http":
            value = next((v for k, v in scope["headers"] if k.lower() == self._key), None)
        if value is None:
            await self.app(scope, receive, send)
            return
        try:
            labels = request_labels(self.header, value.decode("latin-1"), self.allowed)
        except ValueError as e:
            await send_error(send, 400, str(e), "BadRequestError")
            return
        token = REQUEST_LABELS.set(labels)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_LABELS.reset(token)


class LabelSets:
    """The custom labels' values a request's series take: the request's own, until
    `limit` distinct sets have been seen; after that a new set counts as "other"."""

    def __init__(self, names: tuple[str, ...], limit: int = MAX_LABEL_SETS) -> None:
        self.names, self.limit = names, limit
        self._seen: set[tuple[str, ...]] = set()
        self._warned = False

    def values(self, given: dict[str, str] | None) -> tuple[str, ...]:
        got = tuple((given or {}).get(name, "") for name in self.names)
        if got in self._seen or not self.names:
            return got
        if len(self._seen) < self.limit:
            self._seen.add(got)
            return got
        if not self._warned:
            self._warned = True
            log.warning(
                'metrics: %d distinct custom label sets; later ones count as "other"',
                self.limit,
            )
        return ("other",) * len(self.names)


class Metrics:
    def __init__(self, args: Any, engine: AsyncEngine, model_name: str) -> None:
        self.enabled = bool(args.enable_metrics)
        reg = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.custom = allowed_labels(args.tokenizer_metrics_allowed_custom_labels)
        self.label_sets = LabelSets(self.custom)
        per_request = ("model_name", *self.custom)

        def histogram(name: str, doc: str, flag: Any, default: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_request, buckets=flag or default, registry=reg)

        self.ttft = histogram(
            "kiln:time_to_first_token_seconds",
            "Time to first token.",
            args.bucket_time_to_first_token,
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "kiln:inter_token_latency_seconds",
            "Time between output tokens.",
            args.bucket_inter_token_latency,
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "kiln:e2e_request_latency_seconds",
            "Request latency, end to end.",
            args.bucket_e2e_request_latency,
            E2E_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "kiln:prompt_tokens", "Prompt tokens of finished requests.", per_request, registry=reg
        )
        self.generation_tokens = Counter(
            "kiln:generation_tokens", "Generated tokens.", per_request, registry=reg
        )
        self.requests = Counter(
            "kiln:num_requests", "Finished requests.", per_request, registry=reg
        )
        self.token_histograms: tuple[Histogram, Histogram] | None = None
        if args.collect_tokens_histogram:
            self.token_histograms = (
                Histogram(
                    "kiln:prompt_tokens_histogram",
                    "Prompt tokens of finished requests.",
                    per_request,
                    buckets=token_buckets("--prompt-tokens-buckets", args.prompt_tokens_buckets),
                    registry=reg,
                ),
                Histogram(
                    "kiln:generation_tokens_histogram",
                    "Generated tokens of finished requests.",
                    per_request,
                    buckets=token_buckets(
                        "--generation-tokens-buckets", args.generation_tokens_buckets
                    ),
                    registry=reg,
                ),
            )
        pool = engine.engine.runner.pool
        self._prompt_seen = self._prompt_cached = 0
        for name, doc, read in (
            ("kiln:num_running_reqs", "Requests decoding now.", lambda: engine.num_running),
            ("kiln:num_queue_reqs", "Requests waiting to start.", lambda: engine.num_waiting),
            ("kiln:token_usage", "Share of KV-pool pages in use.", lambda: pool.usage),
            (
                "kiln:cache_hit_rate",
                "Share of prompt tokens served from the prefix cache.",
                lambda: self._prompt_cached / max(self._prompt_seen, 1),
            ),
        ):
            gauge = Gauge(name, doc, ("model_name",), registry=reg)
            gauge.labels(model_name).set_function(read)

    def on_output(
        self, out: RequestOutput, first: bool, since_last: float, since_start: float
    ) -> None:
        if not self.enabled:
            return
        labels = (self.model_name, *self.label_sets.values(REQUEST_LABELS.get()))
        n = len(out.token_ids)
        if n:
            self.generation_tokens.labels(*labels).inc(n)
            if first:
                self.ttft.labels(*labels).observe(since_start)
            else:
                itl = self.itl.labels(*labels)
                for _ in range(n):
                    itl.observe(since_last / n)
        if out.finished:
            self.e2e.labels(*labels).observe(since_start)
            self.prompt_tokens.labels(*labels).inc(out.prompt_tokens)
            self._prompt_seen += out.prompt_tokens
            self._prompt_cached += out.cached_tokens
            self.requests.labels(*labels).inc()
            if self.token_histograms is not None:
                self.token_histograms[0].labels(*labels).observe(out.prompt_tokens)
                self.token_histograms[1].labels(*labels).observe(out.completion_tokens)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
