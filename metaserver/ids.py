"""The engine-side request ids a decode engine reports to the metaserver.

vLLM's OpenAI server names a completions prompt ``cmpl-<X-Request-Id>-<i>`` and a chat
request ``chatcmpl-<X-Request-Id>``. vLLM >= 0.14 appends a 9-character suffix
(``-`` + 8 hex digits) to internal ids; vllm-ascend's connector strips it before posting,
but other builds may not, so both forms are accepted.
"""

from __future__ import annotations

import re

_SUFFIX = re.compile(r"-[0-9a-fA-F]{8}$")


def engine_request_ids(engine_request_id: str, chat: bool, num_prompts: int) -> list[str]:
    if chat:
        return [f"chatcmpl-{engine_request_id}"]
    return [f"cmpl-{engine_request_id}-{i}" for i in range(max(num_prompts, 1))]


def candidates(reported_id: str) -> list[str]:
    """The ids to look up for what an engine reported: as given, then without the suffix."""
    stripped = _SUFFIX.sub("", reported_id)
    return [reported_id] if stripped == reported_id else [reported_id, stripped]
