"""Recompute: a decode engine gave the request back, so place it again and carry on.

vLLM-Ascend's decode nodes end a stream with ``stop_reason == "recomputed"`` when they
drop a request they cannot finish (KV lost, preempted). Its proxy then re-places the
request with the text generated so far appended, and asks for the remaining tokens. We
do the same without the client seeing a break: the events before the recomputed one have
already gone out, the continuation's events follow on the same response.

Detection costs one substring search per chunk (the relay holds back an event split
across two reads, so a marker split there is found too); what a continuation needs is
kept as text (``StreamText``), parsed once per 64 KiB of stream, not per chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping

import orjson

from dataplane.errors import APIError
from dataplane.flows.context import FlowContext
from dataplane.hygiene import engine_request_id, new_id
from dataplane.messages import Response, StreamResponse, json_response
from dataplane.observe import current_request_id
from dataplane.placing import place
from dataplane.requests import ClientRequest
from dataplane.upstream import UpstreamError
from protos import omni_proxy_pb2 as pb

Flow = Callable[[FlowContext, pb.Placement], Awaitable["Response | StreamResponse"]]

RECOMPUTED = b'"recomputed"'
MAX_RECOMPUTES = 3


class Recomputed(Exception):
    """Raised by the relay; ``forwarded``: what this attempt already sent (SSE bytes, or the
    relay's ``StreamText`` of them)."""

    def __init__(self, forwarded: bytes | StreamText = b"", response: dict | None = None) -> None:
        super().__init__("the decode engine asked for a recompute")
        self.forwarded = forwarded
        self.response = response     # non-streaming: the engine's (partial) answer


def prefix_before_recompute(chunk: bytes) -> bytes:
    """The whole SSE events of ``chunk`` that come before the recomputed one."""
    at = chunk.find(RECOMPUTED)
    end = chunk.rfind(b"\n\n", 0, at)
    return chunk[:end + 2] if end >= 0 else b""


def is_recomputed(choice: dict) -> bool:
    return choice.get("stop_reason") == "recomputed" or choice.get("finish_reason") == "recomputed"


class StreamText:
    """What a continuation needs of the SSE events a PD stream already sent: their text and
    token count, not the events. The relay adds whole events only (it holds back an event
    split across reads); they are kept as bytes up to ``FOLD_BYTES`` and then parsed into
    text at once, so a long stream holds a few bytes per token, and the parsing happens
    every 64 KiB, never per chunk."""

    __slots__ = ("_raw", "_size", "_parts", "tokens")
    FOLD_BYTES = 64 * 1024

    def __init__(self) -> None:
        self._raw: list[bytes] = []
        self._size = 0
        self._parts: list[str] = []
        self.tokens = 0

    def add(self, events: bytes) -> None:
        self._raw.append(events)
        self._size += len(events)
        if self._size >= self.FOLD_BYTES:
            self._fold()

    def _fold(self) -> None:
        if self._raw:
            text, tokens = _parse_events(b"".join(self._raw))
            self._parts.append(text)
            self.tokens += tokens
            self._raw.clear()
            self._size = 0

    def result(self) -> tuple[str, int]:
        self._fold()
        return "".join(self._parts), self.tokens


def generated_from_stream(forwarded: bytes | StreamText) -> tuple[str, int]:
    """Text and token count the client has already received from an SSE stream."""
    if isinstance(forwarded, StreamText):
        return forwarded.result()
    return _parse_events(forwarded)


def _parse_events(forwarded: bytes) -> tuple[str, int]:
    parts: list[str] = []
    tokens = 0
    for event in forwarded.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        for choice in orjson.loads(event[6:]).get("choices") or []:
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                parts.append(piece)
                tokens += 1
    return "".join(parts), tokens


def generated_from_response(response: dict) -> tuple[str, int]:
    choice = (response.get("choices") or [{}])[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content") or ""
    tokens = int((response.get("usage") or {}).get("completion_tokens") or 0)
    return text, tokens


def continuation(req: ClientRequest, text: str, tokens: int, encode=None) -> ClientRequest | None:
    """The request that asks for what is still missing; None when nothing is.

    ``encode(text) -> ids`` extends token-id prompts (the data plane's tokenizer).
    """
    body = dict(req.body)
    remaining = (req.max_tokens - tokens) if req.max_tokens else 0
    if req.max_tokens and remaining <= 0:
        return None
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and remaining:
            body[key] = remaining
    if req.is_chat:
        messages = list(body.get("messages") or [])
        if body.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
            last = dict(messages[-1])
            last["content"] = (last.get("content") or "") + text
            messages[-1] = last
        else:
            messages.append({"role": "assistant", "content": text})
        body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            body["prompt"] = prompt + text
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and encode is not None:
            body["prompt"] = list(prompt) + list(encode(text))
        else:
            raise ValueError("recompute needs a single text prompt, or token ids and a tokenizer")
    # A new attempt is a new engine request: a fresh id, so it never meets the old one's
    # leftovers (a metaserver entry, a KV lease) on any engine.
    placement_id = new_id()
    return dataclasses.replace(req, raw=orjson.dumps(body), body=body, max_tokens=remaining,
                               placement_id=placement_id,
                               request_id=engine_request_id(req.client_id, placement_id),
                               block_hashes=[], token_ids=None)


def merge_prior(data: bytes, prior_text: str, prior_tokens: int) -> bytes:
    """A non-streamed continuation's answer, with what earlier attempts produced in front."""
    obj = orjson.loads(data)
    choice = (obj.get("choices") or [{}])[0]
    if "text" in choice:
        choice["text"] = prior_text + (choice.get("text") or "")
    elif isinstance(choice.get("message"), dict):
        choice["message"]["content"] = prior_text + (choice["message"].get("content") or "")
    usage = obj.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + prior_tokens
        usage["total_tokens"] = int(usage.get("total_tokens") or 0) + prior_tokens
    return orjson.dumps(obj)


async def run_recomputing(ctx: FlowContext, placement: pb.Placement, flow: Flow, *,
                          flows: Mapping[pb.Flow, tuple[str, Flow]],
                          rehash: Callable[[ClientRequest], Awaitable[None]],
                          encoder: Callable[[], Callable[[str], list[int]] | None]) -> Response | StreamResponse:
    """Run ``flow``; each time D hands the request back, place the continuation and run its
    flow (from ``flows``), at most MAX_RECOMPUTES times.

    ``rehash(req)``: the continuation's block-hash chain (its prompt grew); ``encoder()``:
    how to extend a token-id prompt with text (None without a tokenizer), read when needed
    because the tokenizer may load after the request started.
    """
    recomputes = 0
    while True:
        try:
            return await flow(ctx, placement)
        except Recomputed as rc:
            recomputes += 1
            ctx.metrics.recomputes.inc()
            req = ctx.req
            text, tokens = (generated_from_stream(rc.forwarded) if req.stream
                            else generated_from_response(rc.response or {}))
            try:
                nxt = continuation(req, text, tokens, encoder())
            except ValueError as exc:
                raise UpstreamError(placement.decode.worker_id, f"decode asked for a recompute: {exc}", 200) from exc
            ctx.prior_text += text
            ctx.prior_tokens += tokens
            if nxt is None:  # nothing left to generate: end the answer here
                return await _finish(ctx)
            if recomputes > MAX_RECOMPUTES:
                raise UpstreamError(placement.decode.worker_id,
                                    f"request recomputed {recomputes} times; giving up", 200) from rc
            ctx.tracker.continue_as(nxt, tokens)
            ctx.req = nxt
            current_request_id.set(nxt.request_id)
            await rehash(nxt)
            placement = await place(ctx.placements, nxt, pb.LEG_ENTRY)
            _, next_flow = flows.get(placement.flow, ("", None))
            if next_flow is None:
                raise APIError(501, f"flow {pb.Flow.Name(placement.flow)} is not supported") from rc
            flow = next_flow


async def _finish(ctx: FlowContext) -> Response | StreamResponse:
    """The answer ends with what earlier attempts produced (the request's max_tokens were
    reached across them): the stream's [DONE], or the whole answer."""
    ctx.tracker.finished(ctx.prior_tokens)
    if ctx.out is not None:
        await ctx.out.write(b"data: [DONE]\n\n")
        await ctx.out.write_eof()
        return ctx.out
    return json_response(length_answer(ctx.req, ctx.prior_text, ctx.prior_tokens),
                         headers={"X-Request-Id": ctx.req.echo_id})


def length_answer(req: ClientRequest, text: str, completion_tokens: int) -> dict:
    """An OpenAI completion (or chat completion) object of ``text``, finished by length."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if req.is_chat else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": req.request_id, "object": "chat.completion" if req.is_chat else "text_completion",
            "model": req.model, "choices": [choice],
            "usage": {"prompt_tokens": req.prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": req.prompt_tokens + completion_tokens}}
