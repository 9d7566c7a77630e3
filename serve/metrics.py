"""Prometheus metrics (`--enable-metrics`): latency histograms, request and token counters,
and gauges read from the scheduler at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.args import token_buckets

if TYPE_CHECKING:
    from kiln.runtime.request import RequestOutput
    from kiln.serve.async_engine import AsyncEngine

# Defaults when the --bucket-* flags are not given (seconds).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1, 2, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    def __init__(self, args: Any, engine: AsyncEngine) -> None:
        self.enabled = bool(args.enable_metrics)
        reg = self.registry = CollectorRegistry()

        def histogram(name: str, doc: str, flag: Any, default: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=flag or default, registry=reg)

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
            "kiln:prompt_tokens", "Prompt tokens of finished requests.", registry=reg
        )
        self.generation_tokens = Counter(
            "kiln:generation_tokens", "Generated tokens.", registry=reg
        )
        self.requests = Counter("kiln:num_requests", "Finished requests.", registry=reg)
        self.token_histograms: tuple[Histogram, Histogram] | None = None
        if args.collect_tokens_histogram:
            self.token_histograms = (
                Histogram(
                    "kiln:prompt_tokens_histogram",
                    "Prompt tokens of finished requests.",
                    buckets=token_buckets("--prompt-tokens-buckets", args.prompt_tokens_buckets),
                    registry=reg,
                ),
                Histogram(
                    "kiln:generation_tokens_histogram",
                    "Generated tokens of finished requests.",
                    buckets=token_buckets(
                        "--generation-tokens-buckets", args.generation_tokens_buckets
                    ),
                    registry=reg,
                ),
            )
        pool = engine.engine.runner.pool
        Gauge("kiln:num_running_reqs", "Requests decoding now.", registry=reg).set_function(
            lambda: engine.num_running
        )
        Gauge("kiln:num_queue_reqs", "Requests waiting to start.", registry=reg).set_function(
            lambda: engine.num_waiting
        )
        Gauge("kiln:token_usage", "Share of KV-pool pages in use.", registry=reg).set_function(
            lambda: pool.usage
        )
        self._prompt_seen = self._prompt_cached = 0
        Gauge(
            "kiln:cache_hit_rate",
            "Share of prompt tokens served from the prefix cache.",
            registry=reg,
        ).set_function(lambda: self._prompt_cached / max(self._prompt_seen, 1))

    def on_output(
        self, out: RequestOutput, first: bool, since_last: float, since_start: float
    ) -> None:
        if not self.enabled:
            return
        n = len(out.token_ids)
        if n:
            self.generation_tokens.inc(n)
            if first:
                self.ttft.observe(since_start)
            else:
                for _ in range(n):
                    self.itl.observe(since_last / n)
        if out.finished:
            self.e2e.observe(since_start)
            self.prompt_tokens.inc(out.prompt_tokens)
            self._prompt_seen += out.prompt_tokens
            self._prompt_cached += out.cached_tokens
            self.requests.inc()
            if self.token_histograms is not None:
                self.token_histograms[0].observe(out.prompt_tokens)
                self.token_histograms[1].observe(out.completion_tokens)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
