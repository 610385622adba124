"""What the metaserver needs from the control plane that hosts it, and nothing more.

The metaserver is a guest of the control plane: it places a layerwise request's prefill
leg and reports how the leg went, as a data plane would. It sees the control plane only
through this port, so it imports no ``controlplane`` module (an import-linter contract in
pyproject.toml keeps it so) and its placements take the path of every other request: the
scheduler service implements the port (``controlplane/services.py``), and the composition
root (``controlplane/compose.py``) subscribes :meth:`Metaserver.register` and
:meth:`Metaserver.drop` to the placer's and the lifecycle's hooks.
"""

from __future__ import annotations

from typing import Protocol

from protos import omni_proxy_pb2 as pb


class ControlPlanePort(Protocol):
    async def place(self, req: pb.PlaceRequest) -> pb.Placement:
        """Place one leg (here: LEG_PREFILL, excluding the workers already tried); a refusal
        is an answer with ``error`` set, never an exception."""
        ...

    async def report(self, event: pb.LifecycleEvent) -> None:
        """How a leg went (PREFILL_DONE, LEG_FAILED): releases its load, teaches the breaker."""
        ...
