"""Ray Serve request routers for the engine replicas (plugged in through the deployment's request_router_config).

A router lives in the process that holds the deployment handle (the ingress replica). It ranks candidate replicas;
Ray Serve then sends the request to the least-queued replica of the first rank that is not full
(max_ongoing_requests), so the ranks double as the fallback order. Loads are Ray Serve's own view of each
replica's ongoing requests (its queue-length cache, refreshed by every send and probe).
"""
import itertools

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from quant_serve.server.cluster.prefix_routing import HashRing

PREFIX_KEY_KWARG = "prefix_key"      # the ingress passes the request's prefix key under this keyword


class PrefixAffinityRouter(RequestRouter):
    """Consistent hashing with bounded loads on the request's prefix key (server/cluster/prefix_routing.py)."""

    def initialize_state(self, load_factor: float = 1.25, vnodes: int = 64, **kwargs):
        self.ring = HashRing(vnodes=vnodes, load_factor=load_factor)

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        cache = self.replica_queue_len_cache
        return {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in replicas}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        self.ring.set_members(by_id)
        key = pending_request.kwargs.get(PREFIX_KEY_KWARG) if pending_request is not None else None
        ranked = self.ring.rank(key, self._loads(candidate_replicas))
        # first rank: the key's replica; then the others, least loaded first, one rank together
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]


class RoundRobinRouter(RequestRouter):
    """The baseline: replicas in turn, whatever the prompt (full ones are skipped by Ray Serve)."""

    def initialize_state(self, **kwargs):
        self.turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        start = next(self.turn) % len(ordered)
        ordered = ordered[start:] + ordered[:start]
        return [[ordered[0]], ordered[1:]]


ROUTERS = {"prefix": PrefixAffinityRouter, "round-robin": RoundRobinRouter}
