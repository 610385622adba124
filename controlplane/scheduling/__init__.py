"""Placement as a pipeline of small plugins: filter -> score -> pick (llm-d's shape)."""

from controlplane.scheduling.base import Candidate, Decision, PlacementContext
from controlplane.scheduling.pipeline import POLICIES, Profile, build_profile

__all__ = ["Candidate", "Decision", "PlacementContext", "POLICIES", "Profile", "build_profile"]
