"""Disaggregated prefill/decode's figures in /metrics (SchedulerStats pd_*): handovers, their time,
fallbacks to recompute, requests sent to a prefill worker and those kept whole, and every decision
by where it went and why (the queue rule)."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from llmesh.v1 import worker_pb2


def test_the_handover_counters_are_rendered():
    metrics = GatewayMetrics()
    metrics.scheduler.snapshot = worker_pb2.SchedulerStats(
        pd_disaggregated=5, pd_handovers=4, pd_handover_seconds=0.5, pd_fallbacks=1, pd_kept_whole=7,
        pd_direct=3, pd_direct_failed=1, pd_direct_bytes=1 << 20, pd_direct_copy_seconds=0.25,
        pd_decisions={"prefill/queue_short": 4, "decode/queue_long": 1, "decode/short_prompt": 7},
    )  # fmt: skip
    text = metrics.render().decode()
    for line in (
        "llmesh:pd_disaggregated_total 5.0",
        "llmesh:pd_handovers_total 4.0",
        "llmesh:pd_handover_seconds_total 0.5",
        "llmesh:pd_fallbacks_total 1.0",
        "llmesh:pd_kept_whole_total 7.0",
        "llmesh:pd_direct_total 3.0",
        "llmesh:pd_direct_failed_total 1.0",
        "llmesh:pd_direct_bytes_total 1.048576e+06",
        "llmesh:pd_direct_copy_seconds_total 0.25",
        'llmesh:pd_decisions_total{reason="queue_short",to="prefill"} 4.0',
        'llmesh:pd_decisions_total{reason="queue_long",to="decode"} 1.0',
        'llmesh:pd_decisions_total{reason="short_prompt",to="decode"} 7.0',
    ):
        assert line in text, line
