"""Which replica serves a request: a Ray Serve request router that knows our prefix cache.

A request whose prompt begins as recent requests to one replica did goes to that replica, where
the prefix cache holds that beginning, unless that replica has more than `imbalance` ongoing
requests above the least busy one; any other request goes to the replica with the fewest ongoing
requests. Prompts are matched as chained hashes of fixed-size character blocks (the ingress has no
tokenizer; vLLM's and Ray's prefix-aware routers match characters too), kept per replica in an LRU
table, so a match is always a whole common beginning."""
from __future__ import annotations

from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_CHARS = 128  # about 32 tokens of English
TABLE_BLOCKS = 1 << 16  # per replica: 8 MB of prompt text at most, a few MB of table
MIN_MATCH_BLOCKS = 2  # a shared system line is no reason to prefer a replica
IMBALANCE = 2  # ongoing requests a preferred replica may have above the least busy one

REGISTRY = CollectorRegistry()  # the ingress's process: its /metrics adds it
ROUTED = Counter("specee_routed_requests", "Requests routed, by replica and why it was chosen: prefix (it "
                 "served the same beginning recently) or load (the fewest ongoing requests)", ["replica", "reason"],
                 registry=REGISTRY)


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """One hash per whole block, each of the block and every block before it."""
    hashes, previous = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hash((previous, text[start:start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixAffinityRouter(RequestRouter):
    """No FIFOMixin: it may hand the replica chosen for one request to an older one, which would
    undo the choice."""

    def initialize_state(self, prefix: bool = True, imbalance: int = IMBALANCE) -> None:
        self.prefix = prefix
        self.imbalance = imbalance
        self.tables: dict[ReplicaID, OrderedDict[int, None]] = {}

    def matched_blocks(self, replica: ReplicaID, hashes: list[int]) -> int:
        table = self.tables.get(replica)
        if not table:
            return 0
        count = 0
        for h in hashes:  # a chain: the first miss ends the common beginning
            if h not in table:
                break
            count += 1
        return count

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes = self._hashes(pending_request) if self.prefix else []
        if hashes and len(candidate_replicas) > 1:
            matches = {r.replica_id: self.matched_blocks(r.replica_id, hashes) for r in candidate_replicas}
            best = max(candidate_replicas, key=lambda r: matches[r.replica_id])
            if matches[best.replica_id] >= MIN_MATCH_BLOCKS and not self._much_busier(best, candidate_replicas):
                pending_request.routing_context.prefix_choice = best.replica_id  # read in on_request_routed
                return [[best], [r for r in candidate_replicas if r is not best]]
        return [candidate_replicas]  # the base class takes the one with the fewest ongoing requests

    def _much_busier(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        lengths = [cache.get(r.replica_id) for r in candidates]
        own = cache.get(replica.replica_id)
        if own is None or any(n is None for n in lengths):
            return False  # unknown: the base class probes, and skips a full replica
        return own - min(lengths) > self.imbalance

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None or not pending_request.args:
            return []
        text = getattr(pending_request.args[0], "routing_text", "")
        return block_hashes(text) if text else []

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hit = getattr(pending_request.routing_context, "prefix_choice", None) == replica_id
        # Ray unpickles this class by value, with a copy of this module's globals: count in the
        # imported module, whose registry the ingress's /metrics reads.
        from specee.cluster import router

        router.ROUTED.labels(replica_id.unique_id, "prefix" if hit else "load").inc()
        if not self.prefix:
            return
        table = self.tables.setdefault(replica_id, OrderedDict())
        for h in self._hashes(pending_request):
            table[h] = None
            table.move_to_end(h)
        while len(table) > TABLE_BLOCKS:
            table.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tables.pop(replica_id, None)
