"""Prometheus metrics of the gateway, named after vLLM's (`vllm:x` -> `llmesh:x`) where one exists.

Request-level metrics (latencies, token counts, outcomes) are measured here;
the load of the mesh (running / waiting requests, KV usage, free blocks,
prefix-cache hits) is read from the scheduler's Registry.GetStats at scrape
time. One CollectorRegistry per app: no process-global metric state.

With several gateway processes on one port (`--api-server-count N`), prometheus_client's
multiprocess mode is on (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before any of them
starts): each process's samples go to files in that directory and a scrape, whichever process
answers it, renders their sum, plus the scheduler's gauges once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.generation import Generation
from llmesh.v1 import worker_pb2

# vLLM's buckets, so that dashboards built for vLLM read these the same way.
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
# fmt: on
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SchedulerStatsCollector(Collector):
    """Exposes the last Registry.GetStats snapshot (refreshed by the /metrics handler)."""

    def __init__(self) -> None:
        self.snapshot: worker_pb2.SchedulerStats | None = None

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("llmesh:scheduler_up", "1 when the last stats call to the scheduler worked")
        up.add_metric([], 1.0 if self.snapshot is not None else 0.0)
        yield up
        stats = self.snapshot
        if stats is None:
            return
        gauges = {
            "running": ("llmesh:num_requests_running", "Requests running on the worker's batch"),
            "waiting": ("llmesh:num_requests_waiting", "Requests waiting for the worker"),
            "kv_usage": ("llmesh:kv_cache_usage_perc", "Fraction of the worker's KV blocks in use (0-1)"),
            "free_blocks": ("llmesh:kv_cache_free_blocks", "Free KV blocks of the worker"),
            "num_blocks": ("llmesh:kv_cache_num_blocks", "KV blocks of the worker"),
            # What the KV load predictor predicts from (scheduler_svc/load_predictor.py; 0 = not yet).
            "kv_load_bytes_per_second": (
                "llmesh:kv_load_bandwidth_bytes_per_second",
                "Measured bandwidth of the worker's KV store loads",
            ),
            "kv_prefill_tokens_per_second": (
                "llmesh:kv_prefill_tokens_per_second",
                "Measured marginal prefill rate of the worker",
            ),
        }
        counters = {
            "prefix_queries": ("llmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            "prefix_hits": ("llmesh:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            "preemptions": ("llmesh:num_preemptions", "Requests preempted on the worker"),
            # KV tiers below the GPU cache (vLLM names the KV connector's hits "external").
            "host_hit_tokens": (
                "llmesh:kv_offload_hit_tokens",
                "Prompt tokens loaded from the worker's CPU tier instead of computed",
            ),
            "store_hit_tokens": (
                "llmesh:external_prefix_cache_hits",
                "Prompt tokens loaded from the shared KV store instead of computed",
            ),
            "saved_blocks": ("llmesh:kv_offload_saved_blocks", "KV blocks saved to the worker's CPU tier"),
            "stored_chunks": ("llmesh:kv_store_put_chunks", "KV chunks put to the shared KV store"),
            "failed_loads": (
                "llmesh:kv_store_failed_loads",
                "Requests whose KV store loads failed and were computed instead",
            ),
            "kv_verify_failures": (
                "llmesh:kv_store_verify_failures",
                "KV store chunks refused because their MAC did not verify (forged, altered or swapped)",
            ),
            "kv_load_predictions": (
                "llmesh:kv_load_predictions",
                "KV store loads planned with a predicted time",
            ),
            "kv_load_predicted_seconds": (
                "llmesh:kv_load_predicted_seconds",
                "Seconds the planned KV store loads were predicted to take",
            ),
            "kv_load_skipped": (
                "llmesh:kv_load_skipped",
                "KV store hits computed instead of loaded: loading was predicted slower",
            ),
            "kv_lookups_skipped": (
                "llmesh:kv_lookups_skipped",
                "Requests that skipped the KV store lookup: no hit they could have was predicted to pay",
            ),
            "kv_load_skipped_tokens": (
                "llmesh:kv_load_skipped_tokens",
                "Prompt tokens held by the KV store but computed: loading them was predicted slower",
            ),
            # Speculative decoding, as vLLM's spec_decode counters.
            "spec_num_drafts": ("llmesh:spec_decode_num_drafts", "Verifications that carried draft tokens"),
            "spec_num_draft_tokens": ("llmesh:spec_decode_num_draft_tokens", "Draft tokens verified"),
            "spec_num_accepted_tokens": ("llmesh:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
        }
        for attr, (name, doc) in gauges.items():
            fam = GaugeMetricFamily(name, doc, labels=["worker"])
            for w in stats.workers:
                fam.add_metric([w.worker_id], float(getattr(w, attr)))
            yield fam
        for attr, (name, doc) in counters.items():
            fam = CounterMetricFamily(name, doc, labels=["worker"])
            for w in stats.workers:
                fam.add_metric([w.worker_id], float(getattr(w, attr)))
            yield fam
        per_pos = CounterMetricFamily(
            "llmesh:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            labels=["worker", "position"],
        )
        for w in stats.workers:
            for pos, n in enumerate(w.spec_accepted_per_pos):
                per_pos.add_metric([w.worker_id, str(pos)], float(n))
        yield per_pos
        yield _load_error_histogram(stats)
        workers = GaugeMetricFamily("llmesh:num_workers", "Workers registered with the scheduler")
        workers.add_metric([], float(len(stats.workers)))
        yield workers
        active = GaugeMetricFamily("llmesh:scheduler_active_requests", "Requests the scheduler is streaming")
        active.add_metric([], float(stats.active_requests))
        yield active
        failovers = CounterMetricFamily("llmesh:scheduler_failovers", "Requests moved off a dead worker")
        failovers.add_metric([], float(stats.failovers))
        yield failovers
        refused = CounterMetricFamily(
            "llmesh:scheduler_refused_requests", "Requests the scheduler refused because it was full"
        )
        refused.add_metric([], float(stats.refused))
        yield refused
        backlog = GaugeMetricFamily(
            "llmesh:scheduler_backlog", "Requests waiting beyond the workers' batch slots (bounded)"
        )
        backlog.add_metric([], float(stats.backlog))
        yield backlog
        yield from pd_metrics(stats)


def pd_metrics(stats: worker_pb2.SchedulerStats) -> Iterable[Metric]:
    """Disaggregated prefill/decode (scheduler_svc/disaggregation.py): handovers and their cost."""
    for name, value, doc in (
        ("disaggregated", stats.pd_disaggregated, "Requests sent to a prefill worker"),
        ("handovers", stats.pd_handovers, "Requests handed over from a prefill to a decode worker"),
        ("handover_seconds", stats.pd_handover_seconds, "Seconds from first token to decode placement (sum)"),
        ("fallbacks", stats.pd_fallbacks, "Handovers whose KV the decode worker partly recomputed"),
        ("kept_whole", stats.pd_kept_whole, "Requests kept whole on a decode worker (short prompt)"),
        ("direct", stats.pd_direct, "Handovers the decode worker copied from the prefill worker's cache"),
        ("direct_failed", stats.pd_direct_failed, "Direct handovers whose copy failed (recomputed)"),
        ("direct_bytes", stats.pd_direct_bytes, "KV bytes copied by direct handovers"),
        ("direct_copy_seconds", stats.pd_direct_copy_seconds, "Decode workers' seconds copying them (sum)"),
    ):
        family = CounterMetricFamily(f"llmesh:pd_{name}", doc)
        family.add_metric([], float(value))
        yield family
    decisions = CounterMetricFamily(
        "llmesh:pd_decisions",
        "Requests long enough for a prefill worker, or kept whole for a short prompt: where they went "
        "(prefill or decode) and why (the scheduler's queue rule)",
        labels=["to", "reason"],
    )
    for key, n in sorted(stats.pd_decisions.items()):
        to, _, reason = key.partition("/")
        decisions.add_metric([to, reason], float(n))
    yield decisions


def _load_error_histogram(stats: worker_pb2.SchedulerStats) -> HistogramMetricFamily:
    """|measured - predicted| seconds per KV store load, from the scheduler's bucket counts."""
    fam = HistogramMetricFamily(
        "llmesh:kv_load_prediction_error_seconds",
        "Absolute error of the KV load predictor's load time, per store load",
        labels=["worker"],
    )
    for w in stats.workers:
        bounds, counts = list(w.kv_load_error_bounds), list(w.kv_load_error_counts)
        if len(counts) != len(bounds) + 1:
            continue  # a scheduler without the predictor
        buckets, total = [], 0
        for bound, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
            total += n
            buckets.append((bound, float(total)))
        fam.add_metric([w.worker_id], buckets, sum_value=w.kv_load_error_seconds)
    return fam


def multiprocess_dir() -> str | None:
    """Where prometheus_client's multiprocess mode keeps samples (it reads this at import)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_dir() is not None
        r = self.registry
        self.http_requests = Counter(
            "llmesh:http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.requests_active = Gauge(
            "llmesh:gateway_requests_active",
            "Generation requests in flight in the gateway",
            registry=r,
            multiprocess_mode="livesum",  # summed over the gateway's live processes
        )
        self.request_success = Counter(
            "llmesh:request_success",
            "Finished choices by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        # Admission control (issue 30): refused before they started, answered 429 + Retry-After.
        self.requests_refused = Counter(
            "llmesh:num_requests_refused",
            "Generations the scheduler refused because it was full (HTTP 429 with Retry-After)",
            ["model_name"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "llmesh:prompt_tokens", "Prompt tokens processed", ["model_name"], registry=r
        )
        self.generation_tokens = Counter(
            "llmesh:generation_tokens", "Tokens generated", ["model_name"], registry=r
        )
        self.ttft = Histogram(
            "llmesh:time_to_first_token_seconds",
            "Time to first token",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "llmesh:inter_token_latency_seconds",
            "Time between a choice's successive outputs",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmesh:e2e_request_latency_seconds",
            "End-to-end request latency",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "llmesh:request_prompt_tokens",
            "Prompt tokens per request",
            ["model_name"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "llmesh:request_generation_tokens",
            "Generated tokens per request",
            ["model_name"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.scheduler = SchedulerStatsCollector()
        r.register(self.scheduler)

    def observe(self, model: str, gen: Generation) -> None:
        """Record a generation once it has ended (finished, failed, refused or cancelled)."""
        if gen.refused:  # it never ran: no tokens, no latencies, no finish reason
            self.requests_refused.labels(model).inc()
            return
        t = gen.timings
        self.prompt_tokens.labels(model).inc(len(gen.prompt_ids))
        self.generation_tokens.labels(model).inc(gen.completion_tokens)
        self.request_prompt_tokens.labels(model).observe(len(gen.prompt_ids))
        self.request_generation_tokens.labels(model).observe(gen.completion_tokens)
        if t.first_token is not None:
            self.ttft.labels(model).observe(t.first_token - t.started)
        itl = self.itl.labels(model)
        for gap in t.token_gaps:
            itl.observe(gap)
        if t.finished is not None:
            self.e2e.labels(model).observe(t.finished - t.started)
        for s in gen.states:
            self.request_success.labels(model, s.finish_reason or "abort").inc()

    def render(self) -> bytes:
        if self.multiprocess:
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # every process's samples, this one's included
            registry.register(self.scheduler)
            return generate_latest(registry)
        return generate_latest(self.registry)
