"""Where the control plane keeps its global state: in memory by default, Redis later."""

from controlplane.state.base import Charge, Ledger, RequestRecord, SpecStore, StateStore
from controlplane.state.memory import MemoryStore

__all__ = ["Charge", "Ledger", "MemoryStore", "RequestRecord", "SpecStore", "StateStore"]
