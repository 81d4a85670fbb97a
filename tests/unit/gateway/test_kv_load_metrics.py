"""The KV load predictor's figures in /metrics: vLLM-style names, a histogram of its error."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from llmesh.v1 import worker_pb2


def test_the_predictor_counters_gauges_and_error_histogram_are_rendered():
    metrics = GatewayMetrics()
    worker = worker_pb2.WorkerStats(
        worker_id="w0",
        kv_load_predictions=3,
        kv_load_predicted_seconds=0.25,
        kv_load_skipped=2,
        kv_load_skipped_tokens=512,
        kv_load_error_bounds=[0.001, 0.01],
        kv_load_error_counts=[1, 2, 1],
        kv_load_error_seconds=0.5,
        kv_load_bytes_per_second=1.5e10,
        kv_prefill_tokens_per_second=32000.0,
    )
    metrics.scheduler.snapshot = worker_pb2.SchedulerStats(workers=[worker])
    text = metrics.render().decode()
    for line in (
        'llmesh:kv_load_predictions_total{worker="w0"} 3.0',
        'llmesh:kv_load_predicted_seconds_total{worker="w0"} 0.25',
        'llmesh:kv_load_skipped_total{worker="w0"} 2.0',
        'llmesh:kv_load_skipped_tokens_total{worker="w0"} 512.0',
        'llmesh:kv_load_bandwidth_bytes_per_second{worker="w0"} 1.5e+10',
        'llmesh:kv_prefill_tokens_per_second{worker="w0"} 32000.0',
        'llmesh:kv_load_prediction_error_seconds_bucket{le="0.001",worker="w0"} 1.0',
        'llmesh:kv_load_prediction_error_seconds_bucket{le="0.01",worker="w0"} 3.0',
        'llmesh:kv_load_prediction_error_seconds_bucket{le="+Inf",worker="w0"} 4.0',
        'llmesh:kv_load_prediction_error_seconds_count{worker="w0"} 4.0',
        'llmesh:kv_load_prediction_error_seconds_sum{worker="w0"} 0.5',
    ):
        assert line in text, line
