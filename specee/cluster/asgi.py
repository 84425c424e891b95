"""A request that crossed from the ingress to a replica, run through the replica's ASGI app in
process: its response comes back as a start (status, headers) and then the body's chunks, as the
app sends them, so a stream stays a stream."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass
class Forwarded:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing_text: str = ""  # what the router matches against recent traffic (the prompt); "" routes by load


@dataclass
class Start:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)


def routing_text(path: str, body: bytes) -> str:
    """The part of a request that a prefix cache would reuse: tools and messages as the chat
    template would see them, or a completion's prompt. "" where there is none (or bad JSON: the
    replica answers that with its own 400)."""
    try:
        request = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    if path.endswith("/chat/completions"):
        return json.dumps([request.get("tools"), request.get("messages")], ensure_ascii=False, default=str)
    if path.endswith("/completions"):
        prompt = request.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)
    return ""


async def call(app, request: Forwarded) -> AsyncIterator[Start | bytes]:
    """Run `request` through `app`, yielding the response's Start, then its non-empty body chunks.
    Closing this generator early (the client left) disconnects the request, as a socket would."""
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
             "query_string": request.query, "headers": request.headers, "client": ("ingress", 0),
             "server": ("replica", 0)}
    task = asyncio.create_task(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # the app returned: nothing more will come
    try:
        while True:
            message = await sent.get()
            if message is None:  # returned (or raised) without finishing its response
                task.result()
                raise RuntimeError(f"{request.method} {request.path} ended without a whole response")
            if message["type"] == "http.response.start":
                yield Start(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    await task
                    return
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()  # the client left mid-response: the app's own cleanup cancels its generations
