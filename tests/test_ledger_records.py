"""The ledger's cheap record constructor is the same immutable update as dataclasses.replace."""

from __future__ import annotations

import dataclasses

from controlplane.state import Charge, MemoryStore, RequestRecord
from controlplane.state.base import with_charges


def _distinct_record() -> RequestRecord:
    """A record whose every field holds a value no other field holds (a field passed to the
    wrong position, or left out, shows)."""
    values = {}
    for i, f in enumerate(dataclasses.fields(RequestRecord)):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if f.name == "charges":
            values[f.name] = (Charge(worker_id="w0", leg="prefill", tokens=7, prefill_tokens=3),)
        elif kind == "str":
            values[f.name] = f"v{i}"
        elif kind == "int":
            values[f.name] = 1000 + i
        else:
            values[f.name] = 0.5 + i
    return RequestRecord(**values)


def test_with_charges_keeps_every_other_field_in_place():
    r = _distinct_record()
    added = r.charges + (Charge(worker_id="w1", leg="decode", tokens=9),)
    assert with_charges(r, added) == dataclasses.replace(r, charges=added)
    assert with_charges(r, added) is not r and r.charges != added   # a new value; r unchanged


async def test_memory_store_reserve_new_and_later_leg():
    store = MemoryStore()
    template = dataclasses.replace(_distinct_record(), charges=())
    first = (Charge(worker_id="p", leg="prefill", tokens=10, prefill_tokens=4),)
    got = await store.reserve(template, first, predicted_ttft_s=9.0)
    # A new record: the template's fields (notes are for an existing record only) and its charges.
    assert got == dataclasses.replace(template, charges=first)
    assert (await store.loads(["p"]))["p"].requests == 1
    later = (Charge(worker_id="d", leg="decode", tokens=12),)
    again = await store.reserve(template, later, decode_batch=3)
    assert again == dataclasses.replace(got, charges=first + later, decode_batch=3)
    assert await store.get(template.request_id) == again
    ended = await store.end(template.request_id)
    assert ended == again
    assert (await store.loads(["p", "d"]))["p"].requests == (await store.loads(["d"]))["d"].requests == 0
