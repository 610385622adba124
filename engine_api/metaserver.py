"""The metaserver's addresses, as the data plane and the metaserver both need them.

A layerwise placement carries the metaserver's URL with the request's token
(``http://host:port/v1/metaserver?token=T``): the decode engine calls it with its KV
destination, and the data plane hands the request itself over to :func:`body_url` first,
so the placement session carries ids only (metaserver/server.py).
"""

from __future__ import annotations

from urllib.parse import quote

BODY_ROUTE = "/body/{placement_id}"     # under the metaserver's path


def body_url(metaserver_url: str, placement_id: str) -> str:
    """Where the data plane hands a layerwise request over: the placement's metaserver URL,
    the request's placement id, and the token the URL carries."""
    base, _, query = metaserver_url.partition("?")
    return f"{base}{BODY_ROUTE.format(placement_id=quote(placement_id, safe=''))}?{query}"
