"""Where the control plane keeps its global state: in memory by default, or in Redis."""

from controlplane.state.base import Charge, Ledger, RequestRecord, SpecStore, StateStore, StoreUnavailable
from controlplane.state.memory import MemoryStore

__all__ = ["Charge", "Ledger", "MemoryStore", "RequestRecord", "SpecStore", "StateStore", "StoreUnavailable",
           "make_store"]


def make_store(config) -> StateStore:
    """The backend ``[state]`` names: MemoryStore, or a RedisStore (imported only then)."""
    state = getattr(config, "state", None)
    if state is None or state.backend == "memory":
        return MemoryStore()
    from controlplane.state.redis import RedisStore
    from controlplane.state.resilient import ResilientStore

    # Behind a local ledger: placement goes on from memory while Redis is away.
    return ResilientStore(RedisStore(state.redis_url, key_prefix=state.key_prefix,
                                     replica_ttl_s=state.replica_ttl_s, loads_max_age_s=state.loads_max_age_s,
                                     write_behind=state.write_behind))
