"""A session's answers: placements queued while the last write was in flight leave as one
batch, each placement exactly as decided (the session copies it once, into the batch)."""

from __future__ import annotations

import asyncio

from bench.session_cost import control_plane
from protos import omni_proxy_pb2 as pb


async def test_answers_queued_together_leave_as_one_batch_of_the_same_placements():
    c = await control_plane("a", "b")
    incoming: asyncio.Queue = asyncio.Queue()

    async def messages():
        yield pb.DataPlaneMessage(open=pb.SessionOpen(node_id="n", batches=True))
        while (m := await incoming.get()) is not None:
            yield m

    answers = c.scheduler.Session(messages(), None)
    try:
        assert (await answers.__anext__()).WhichOneof("body") == "info"
        batch = pb.DataPlaneMessage()
        for i in range(1, 9):
            batch.batch.messages.add().place.CopyFrom(pb.PlaceRequest(
                seq=i, request_id=f"r{i}", model="m", leg=pb.LEG_ENTRY, prompt_tokens=12, max_tokens=4))
        incoming.put_nowait(batch)
        got: list[pb.ControlPlaneMessage] = []
        bodies = []
        while len(got) < 8:
            msg = await asyncio.wait_for(answers.__anext__(), 10)
            bodies.append(msg.WhichOneof("body"))
            parts = msg.batch.messages if bodies[-1] == "batch" else [msg]
            got += [m for m in parts if m.WhichOneof("body") == "placement"]
        # All eight were decided in one turn: one write for the first, one batch for the rest.
        assert "batch" in bodies
        assert [m.placement.seq for m in got] == list(range(1, 9))
        assert [m.placement.request_id for m in got] == [f"r{i}" for i in range(1, 9)]
        assert [m.placement.decode.worker_id for m in got] == ["a", "b"] * 4
        assert all(m.placement.decode.url.endswith(m.placement.decode.worker_id) and not m.placement.error
                   for m in got)
        assert (await c.store.loads(["a"]))["a"].requests == 4
    finally:
        incoming.put_nowait(None)
        await answers.aclose()
