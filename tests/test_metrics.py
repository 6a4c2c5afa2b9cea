"""The coordinator's per-request histograms and their Prometheus text, without a server."""
from dataclasses import fields

from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import COUNTERS, RequestCounts, endpoint_of, prometheus_text
from model.protocol import StepCounters
from workers.metrics import Histogram, RequestMetrics
from workers.request import RequestOutput


def test_histogram_buckets_are_inclusive_upper_bounds():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 7.0):
        h.observe(v)
    assert h.snapshot() == {"buckets": [(1.0, 2), (2.0, 4)], "count": 5, "sum": 12.0}


def test_every_step_counter_is_documented_and_nothing_else():
    """/metrics exports the counters by this table's names: a counter added to StepCounters without a line
    here would be missing from /metrics, a line for a counter that is gone would fail every scrape."""
    assert set(COUNTERS) == {f.name for f in fields(StepCounters)}


def test_prometheus_text_of_stats():
    m = RequestMetrics()
    m.observe(RequestOutput("a", [1] * 32, ttft_s=0.2))
    m.observe(RequestOutput("a", [1] * 32, inter_block_s=0.03, finished=True, finish_reason="length",
                            denoising_steps=16, canvases=2, completion_tokens=64, e2e_s=0.3))
    m.observe(RequestOutput("b", [], finished=True, finish_reason="abort", e2e_s=0.01))   # a cancel: no tokens
    requests = RequestCounts()
    for path, status in (("/app/v1/completions", 200), ("/v1/chat/completions", 200), ("/v1/completions", 400),
                         ("/metrics", 200)):
        requests.add(endpoint_of(path), status)
    stats = {"counters": dict(committed_tokens=64, denoising_steps=16, canvas_positions=512, canvases=2, forwards=20,
                             passes=9),
             "running": 0, "waiting": 3, "free_slots": 4, "num_slots": 4, "shard_failures": 1, "shard_restarts": 1,
             "shard_busy_s": 2.5, "derived": {"steps_per_canvas": 8.0, "committed_throughput": None},
             "kv_cache_usage": 0.25, "kv_cache_tokens": 4096, "prefix_cache_queries": 300, "prefix_cache_hits": 128,
             "graphs": {"eager_steps": 3, "captured_after_ready": 0, "kernel_compiles": 2},
             "warm_up": {"graphs": {"canvas": 64, "prefill": 40}, "graph_bytes": 2**30, "seconds": 12.5},
             **m.snapshot()}
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
               for f in text_string_to_metric_families(prometheus_text(stats, "tiny", requests)) for s in f.samples}
    assert samples[("dllm_requests_total", (("endpoint", "completions"), ("status", "200")))] == 1
    assert samples[("dllm_requests_total", (("endpoint", "chat_completions"), ("status", "200")))] == 1
    assert samples[("dllm_requests_total", (("endpoint", "completions"), ("status", "400")))] == 1
    assert len([k for k in samples if k[0] == "dllm_requests_total"]) == 3   # /metrics is not a generation endpoint
    assert samples[("dllm_finished_requests_total", (("reason", "length"),))] == 1
    assert samples[("dllm_finished_requests_total", (("reason", "abort"),))] == 1
    assert samples[("dllm_time_to_first_token_seconds_count", ())] == 1
    assert samples[("dllm_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
    assert samples[("dllm_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert samples[("dllm_inter_block_latency_seconds_count", ())] == 1
    assert samples[("dllm_e2e_request_latency_seconds_count", ())] == 2
    assert samples[("dllm_tokens_per_step_sum", ())] == 4.0 and samples[("dllm_tokens_per_step_count", ())] == 1
    assert samples[("dllm_waiting", ())] == 3 and samples[("dllm_shard_restarts_total", ())] == 1
    assert samples[("dllm_shard_busy_seconds_total", ())] == 2.5
    assert samples[("dllm_committed_tokens_total", ())] == 64 and samples[("dllm_steps_per_canvas", ())] == 8.0
    assert samples[("dllm_passes_total", ())] == 9
    assert not any(name == "dllm_committed_throughput" for name, _ in samples)   # undefined ratios are left out
    assert samples[("dllm_eager_steps_total", ())] == 3 and samples[("dllm_graph_captures_total", ())] == 0
    assert samples[("dllm_kernel_compiles_total", ())] == 2
    assert samples[("dllm_cuda_graphs", ())] == 104 and samples[("dllm_cuda_graph_memory_bytes", ())] == 2**30
    assert samples[("dllm_warm_up_seconds", ())] == 12.5
    assert samples[("dllm_kv_cache_usage", ())] == 0.25 and samples[("dllm_kv_cache_tokens", ())] == 4096
    assert samples[("dllm_prefix_cache_queries_total", ())] == 300 and samples[("dllm_prefix_cache_hits_total", ())] == 128
