"""Prometheus metrics under vLLM's names and labels, in a registry owned by one app (several apps can live in one
process, e.g. in tests). Gauges and counters are read from the engine snapshot at scrape time; latency histograms
are observed by the engine thread as outputs arrive."""
import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from quant_serve.engine.outputs import RequestOutput
from quant_serve.server.async_engine import EngineSnapshot

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value (max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _SnapshotCollector:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        gauges = [("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", s.kv_cache_usage)]
        counters = [("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens_total),
                    ("vllm:generation_tokens", "Generated tokens.", s.generation_tokens_total),
                    ("vllm:num_preemptions", "Preemptions.", s.num_preemptions_total),
                    ("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.",
                     s.prefix_cache_queries_total),
                    ("vllm:prefix_cache_hits", "Tokens served by the prefix cache.", s.prefix_cache_hits_total),
                    ("vllm:spec_decode_num_drafts", "Speculative proposals verified.", s.spec_num_drafts_total),
                    ("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.",
                     s.spec_num_draft_tokens_total),
                    ("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                     s.spec_num_accepted_tokens_total),
                    ("vllm:structured_output_forced_tokens", "Generated tokens a grammar forced, appended without a "
                     "forward each (jump-forward).", s.structured_forced_tokens_total)]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, value in counters:   # CounterMetricFamily appends the _total suffix
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative tokens accepted, by position in the proposal.",
                                      labels=["model_name", "position"])
        for position, value in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos


class ServerMetrics:
    """As in vLLM V1, each of a request's n sequences counts as a request in request_success and the per-request
    token histograms; the latency histograms count engine requests."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot], max_model_len: int):
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(model_name, snapshot))
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: list[float]):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a sequence.",
                             ITL_BUCKETS)
        # vLLM's older name for the same observations, which its Grafana dashboard reads
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token (inter-token latency).",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                                    REQUEST_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                           token_buckets)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason (stop, length, abort).",
                               ["model_name", "finished_reason"], registry=self.registry)
        self._lock = threading.Lock()
        self._last_token_time: dict[tuple[str, int], float] = {}   # (request id, choice index) -> time
        self._started: set[str] = set()                            # requests whose first token was observed

    def observe(self, out: RequestOutput, now: float) -> None:
        """Called by the engine thread with each output of each step."""
        with self._lock:
            m = out.metrics
            if out.request_id not in self._started and m is not None and m.first_token_time is not None:
                self._started.add(out.request_id)
                self.ttft.observe(m.first_token_time - m.arrival_time)
            for choice in out.outputs:
                if not choice.delta_token_ids:
                    continue
                key = (out.request_id, choice.index)
                last = self._last_token_time.get(key)
                if last is not None:
                    self.itl.observe(now - last)
                    self.tpot.observe(now - last)
                self._last_token_time[key] = now
            if out.finished:
                for choice in out.outputs:
                    self.success.labels(self.model_name, choice.finish_reason).inc()
                    self.prompt_tokens.observe(len(out.prompt_token_ids))
                    self.generation_tokens.observe(len(choice.token_ids))
                if m is not None:
                    self.e2e.observe((m.finished_time or now) - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                self._forget(out.request_id, len(out.outputs))

    def forget(self, request_id: str, num_aborted: int = 0) -> None:
        """An aborted request (its client went away, or it failed): num_aborted of its sequences had not finished."""
        with self._lock:
            if num_aborted:
                self.success.labels(self.model_name, "abort").inc(num_aborted)
            self._forget(request_id, None)

    def _forget(self, request_id: str, num_choices: int | None) -> None:
        self._started.discard(request_id)
        if num_choices is not None:
            for i in range(num_choices):
                self._last_token_time.pop((request_id, i), None)
        else:
            for key in [k for k in self._last_token_time if k[0] == request_id]:
                del self._last_token_time[key]
