"""Each engine replica's figures through Ray's metrics export (Prometheus, scraped from every node's metrics
agent), where Ray Serve labels them with the replica, deployment and application. The single server's /metrics
names (vllm:...) stay on each replica's app; these are the cluster-wide view."""
from dataclasses import fields

from ray.serve import metrics

from quant_serve.server.async_engine import EngineSnapshot

GAUGES = {"num_running": "Requests in the replica's running batch.",
          "num_waiting": "Requests waiting in the replica's queue.",
          "kv_cache_usage": "The replica's KV cache usage (1 = full)."}
COUNTERS = {"prompt_tokens_total": "Prefill tokens the replica processed.",
            "generation_tokens_total": "Tokens the replica generated.",
            "prefix_cache_queries_total": "Prompt tokens the replica looked up in its prefix cache.",
            "prefix_cache_hits_total": "Prompt tokens the replica's prefix cache served.",
            "requests_finished_total": "Requests the replica finished."}
assert set(GAUGES) | set(COUNTERS) <= {f.name for f in fields(EngineSnapshot)}


class ReplicaMetrics:
    def __init__(self, model_name: str):
        # Ray Serve adds its replica, deployment and application tags itself (set_default_tags would clash with them)
        self.tags = {"model_name": model_name}
        self.gauges = {name: metrics.Gauge(f"quant_serve_{name}", doc, tag_keys=("model_name",))
                       for name, doc in GAUGES.items()}
        # Ray appends nothing to counter names: quant_serve_prefix_cache_hits_total and so on
        self.counters = {name: metrics.Counter(f"quant_serve_{name}", doc, tag_keys=("model_name",))
                         for name, doc in COUNTERS.items()}
        self.last = EngineSnapshot()

    def update(self, snapshot: EngineSnapshot) -> None:
        for name, gauge in self.gauges.items():
            gauge.set(getattr(snapshot, name), tags=self.tags)
        for name, counter in self.counters.items():
            delta = getattr(snapshot, name) - getattr(self.last, name)
            if delta > 0:
                counter.inc(delta, tags=self.tags)
        self.last = snapshot
