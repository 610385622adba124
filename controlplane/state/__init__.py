"""Where the control plane keeps its global state: in memory by default, or in Redis."""

from controlplane.state.base import (
    Charge,
    ClosableStore,
    Ledger,
    NotifiesLoads,
    ReportsAvailability,
    RequestRecord,
    SharedStore,
    SpecStore,
    StateStore,
    StoreUnavailable,
    VersionedSpecs,
    WatchableSpecs,
)
from controlplane.state.memory import MemoryStore

__all__ = ["Charge", "ClosableStore", "Ledger", "MemoryStore", "NotifiesLoads", "ReportsAvailability", "RequestRecord",
           "SharedStore", "SpecStore", "StateStore", "StoreUnavailable", "VersionedSpecs", "WatchableSpecs",
           "make_store"]


def make_store(config) -> StateStore:
    """The backend ``[state]`` names: MemoryStore, or a RedisStore (imported only then)."""
    state = getattr(config, "state", None)
    if state is None or state.backend == "memory":
        return MemoryStore()
    from controlplane.state.redis import RedisStore
    from controlplane.state.resilient import ResilientStore

    if getattr(state, "ledger", "shared") == "local":
        from controlplane.state.local import LocalLedgerStore

        # This replica's ledger in memory, published in batches; other replicas' loads read
        # every loads_max_age_s (0.05 s when 0). Resilient by itself: it never awaits Redis
        # to place.
        return LocalLedgerStore(RedisStore(state.redis_url, key_prefix=state.key_prefix,
                                           replica_ttl_s=state.replica_ttl_s, socket_timeout_s=state.op_timeout_s),
                                flush_interval_s=state.flush_interval_s, refresh_s=state.loads_max_age_s or 0.05)
    # Behind a local ledger: placement goes on from memory while Redis is away.
    # A hung Redis (no answer within op_timeout_s) is an outage like a refused connection.
    return ResilientStore(RedisStore(state.redis_url, key_prefix=state.key_prefix,
                                     replica_ttl_s=state.replica_ttl_s, loads_max_age_s=state.loads_max_age_s,
                                     write_behind=state.write_behind, socket_timeout_s=state.op_timeout_s))
