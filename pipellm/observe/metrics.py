"""Prometheus metrics of the server, in a registry of its own (so tests and embedders never collide on the global one).

Request-level metrics are observed on the event loop as each request's tokens arrive. Engine-level ones (queue
lengths, KV cache, generated tokens, per-stage figures) are read at scrape time from the snapshot the engine thread keeps, so a scrape
never calls into the engine.
"""
import time
from collections.abc import Callable

from pipellm.extras import require_extra

require_extra("serve", "pipellm serve's /metrics")
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], object] | None = None):
        """snapshot() returns the engine thread's latest EngineStats."""
        self.registry = CollectorRegistry()
        labels, r = ["model_name"], self.registry

        def child(metric):
            return metric.labels(model_name)

        self.prompt_tokens = child(Counter("pipellm:prompt_tokens", "Prompt tokens of admitted requests.",
                                           labels, registry=r))
        self.finished = Counter("pipellm:request_finished", "Finished completions by finish reason "
                                "(stop, length, abort).", labels + ["finished_reason"], registry=r)
        self.ttft = child(Histogram("pipellm:time_to_first_token_seconds", "Arrival to first token.", labels,
                                    buckets=_TTFT_BUCKETS, registry=r))
        self.itl = child(Histogram("pipellm:inter_token_latency_seconds", "Time between a completion's tokens.",
                                   labels, buckets=_ITL_BUCKETS, registry=r))
        self.e2e = child(Histogram("pipellm:e2e_request_latency_seconds", "Arrival to the last token.", labels,
                                   buckets=_E2E_BUCKETS, registry=r))
        self.model_name = model_name
        if snapshot is not None:
            r.register(_EngineCollector(model_name, snapshot))

    def on_request(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_delta(self, token_times: list[float], prev_time: float | None, arrival: float,
                 finish_reason: str | None) -> None:
        """One completion's new tokens (their arrival times); prev_time is its previous token's, None before the
        first. Times are time.monotonic()."""
        if token_times:
            if prev_time is None:
                self.ttft.observe(token_times[0] - arrival)
            else:
                self.itl.observe(token_times[0] - prev_time)
            for a, b in zip(token_times, token_times[1:]):
                self.itl.observe(b - a)
        if finish_reason is not None:
            self.finished.labels(self.model_name, finish_reason).inc()
            self.e2e.observe((token_times[-1] if token_times else time.monotonic()) - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, model_name: str, snapshot: Callable[[], object]):
        self.model_name, self.snapshot = model_name, snapshot

    def collect(self):
        stats, m = self.snapshot(), [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        yield gauge("pipellm:num_requests_running", "Requests (completions) holding KV blocks.", stats.num_running)
        yield gauge("pipellm:num_requests_waiting", "Requests (completions) queued.", stats.num_waiting)
        yield gauge("pipellm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).",
                    stats.kv_cache_usage)
        yield gauge("pipellm:prefix_cache_hit_rate", "Fraction of looked-up prompt tokens found in the prefix cache.",
                    stats.prefix_cache_hit_rate)
        for name, doc, value in (
                ("pipellm:generation_tokens", "Tokens generated, also for requests aborted later.",
                 stats.num_generated_tokens),
                ("pipellm:spec_decode_num_draft_tokens", "Draft tokens run (speculative decoding).",
                 stats.num_draft_tokens),
                ("pipellm:spec_decode_num_accepted_tokens", "Draft tokens kept (speculative decoding).",
                 stats.num_accepted_tokens)):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(m, value)
            yield counter
        if stats.loras is not None:  # vLLM's: the adapters in use as labels, the time of this snapshot as value
            info = GaugeMetricFamily("pipellm:lora_requests_info", "LoRA adapters of running and waiting requests.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(stats.loras[0]), *stats.loras[1:]], time.time())
            yield info
        restarts = CounterMetricFamily("pipellm:pipeline_restarts", "Pipelines started anew after a stage failed.",
                                       labels=["model_name"])
        restarts.add_metric(m, stats.num_restarts)
        yield restarts
        busy = CounterMetricFamily("pipellm:stage_busy_seconds", "Seconds each stage spent computing "
                                   "(refreshed every few seconds).", labels=["model_name", "stage"])
        sent = CounterMetricFamily("pipellm:stage_activation_bytes_sent", "Bytes of activations each stage sent "
                                   "to the next (refreshed every few seconds).",
                                   labels=["model_name", "stage", "boundary"])
        reports = stats.stage_reports
        for rep in reports:
            busy.add_metric(m + [str(rep.rank)], rep.busy_s)
            if rep.rank < len(reports) - 1:  # the last stage sends tokens back, not activations
                sent.add_metric(m + [str(rep.rank), f"{rep.rank}->{rep.rank + 1}"], rep.activation_bytes_sent)
        yield busy
        yield sent
        weights = GaugeMetricFamily("pipellm:stage_weight_bytes", "Bytes of weights each stage holds, by format "
                                    "(Q4_1, F32, ...).", labels=["model_name", "stage", "format"])
        memory = GaugeMetricFamily("pipellm:stage_memory_bytes", "Each stage's KV cache and resident memory "
                                   "(refreshed every few seconds).", labels=["model_name", "stage", "kind"])
        for rep in reports:
            for fmt, n in rep.weight_bytes:
                weights.add_metric(m + [str(rep.rank), fmt], n)
            memory.add_metric(m + [str(rep.rank), "kv_cache"], rep.kv_cache_bytes)
            memory.add_metric(m + [str(rep.rank), "resident"], rep.rss_bytes)
        yield weights
        yield memory
