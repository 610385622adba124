"""A zero-latency OpenAI engine for overhead benchmarks: answers at once, costs little CPU.

    python bench/mock_engine.py --port 0 --ready-file F [--tokens 16]

A raw asyncio protocol (uvloop when installed), HTTP/1.1 keep-alive. POST
``/v1/completions`` and ``/v1/chat/completions``: a non-streamed JSON answer with
``Content-Length``, or (``"stream": true`` in the body) ``--tokens`` SSE events and
``data: [DONE]``, chunked, one event per loop turn so a proxy sees one read per token as
with a real engine. Any GET answers 200 (``/v1/models`` with a model list, ``/metrics``
empty), enough for the routers' health checks. The answers are prebuilt bytes: the
engine's CPU per request is parsing the request head plus a few writes, and the benchmark
measures it separately (``/proc/<pid>/stat``).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast
import json
import os
import socket

MODEL = "sim-model"


def _answers(tokens: int) -> dict[tuple[bool, bool], tuple[bytes, list[bytes]]]:
    """(chat, stream) -> (head, body parts)."""
    out = {}
    text = "tok " * tokens
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    for chat in (False, True):
        if chat:
            body = {"id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "length"}], "usage": usage}
        else:
            body = {"id": "cmpl-mock", "object": "text_completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
                    "usage": usage}
        data = json.dumps(body, separators=(",", ":")).encode()
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(data)).encode() + b"\r\n\r\n")
        out[(chat, False)] = (head, [data])
        events = []
        for i in range(tokens):
            last = i == tokens - 1
            if chat:
                ev = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                      "choices": [{"index": 0, "delta": {"content": "tok "},
                                   "finish_reason": "length" if last else None}]}
            else:
                ev = {"id": "cmpl-mock", "object": "text_completion", "created": 0, "model": MODEL,
                      "choices": [{"index": 0, "text": "tok ", "finish_reason": "length" if last else None}]}
            events.append(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
        chunks[-1] += b"0\r\n\r\n"
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        out[(chat, True)] = (head, chunks)
    return out


MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                 "owned_by": "mock"}]}).encode()


# /server_info, /get_model_info, /get_server_info (SGLang's; smg reads the model name there)
INFO = json.dumps({"model_path": MODEL, "served_model_name": MODEL, "tokenizer_path": MODEL,
                   "is_generation": True}).encode()


def _get_answer(path: bytes) -> bytes:
    body = MODELS if path.startswith(b"/v1/models") else (b"" if path.startswith(b"/metrics") else INFO)
    ctype = b"text/plain" if path.startswith(b"/metrics") else b"application/json"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


class Engine(asyncio.Protocol):
    answers: dict = {}

    def __init__(self) -> None:
        self.buf = b""
        # None until asyncio calls connection_made (its first call): typed as set.
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            low = head.lower()
            at = low.find(b"content-length:")
            length = 0
            if at >= 0:
                stop = low.find(b"\r\n", at)
                length = int(low[at + 15:stop if stop >= 0 else None])
            if len(buf) < end + 4 + length:
                break
            body = buf[end + 4:end + 4 + length]
            buf = buf[end + 4 + length:]
            self._answer(head, body)
        self.buf = buf

    def _answer(self, head: bytes, body: bytes) -> None:
        line_end = head.find(b"\r\n")
        method, path, _ = head[:line_end].split(b" ", 2)
        if method != b"POST":
            self.transport.write(_get_answer(path))
            return
        stream = b'"stream":true' in body or b'"stream": true' in body
        chat = b"/chat/" in path
        head_bytes, parts = self.answers[(chat, stream)]
        if not stream:
            self.transport.write(head_bytes + parts[0])
            return
        self.transport.write(head_bytes)
        self._next(parts, 0)

    def _next(self, parts: list[bytes], i: int) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(parts[i])
        if i + 1 < len(parts):
            self.loop.call_soon(self._next, parts, i + 1)


async def serve(port: int, ready_file: str | None, tokens: int) -> None:
    Engine.answers = _answers(tokens)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Engine, "127.0.0.1", port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": bound, "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
    print(f"mock engine on 127.0.0.1:{bound}", flush=True)
    await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", default=None)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.ready_file, args.tokens))


if __name__ == "__main__":
    main()
