"""Where the control plane keeps its global state: in memory by default, Redis later."""

from controlplane.state.base import Charge, RequestRecord, StateStore
from controlplane.state.memory import MemoryStore

__all__ = ["Charge", "MemoryStore", "RequestRecord", "StateStore"]
