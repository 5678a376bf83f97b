"""Run one HTTP request through an in-process ASGI app (the replica's `polykv.server` app) and hand
its response back as Python values, so the whole request can travel over a Ray call.

    async for part in call_app(app, req):
        ...   # first: {"status", "headers", "body"} (the start and the first body chunk together);
              # then: bytes (further body chunks, e.g. SSE events)

`req`: {"method": str, "path": str, "query": bytes, "headers": [(bytes, bytes)], "body": bytes}.

Why the start travels with the first chunk: a JSON answer (every non-streaming request) is then a
single item, so a replica that dies before answering has sent nothing and the request can be
retried elsewhere; a stream's first item carries its first event.

Disconnects: the app's `request.is_disconnected()` turns true when the consumer stops iterating
(the client went away and Serve cancelled the call), so the engine drops the agent as it does under
uvicorn. The app's own lifespan is not run: `create_app` starts its engine at once; the replica
shuts it down.
"""

from __future__ import annotations

import asyncio

__all__ = ["call_app"]

_END = object()


async def call_app(app, req: dict, extra_headers: list[tuple[bytes, bytes]] = ()):
    body = req.get("body", b"") or b""
    path = req["path"]
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": req["method"].upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
        "root_path": "", "query_string": req.get("query", b"") or b"",
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in req.get("headers", ())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": list(message.get("headers") or []) + list(extra_headers)}
        await out.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        except BaseException as exc:  # the app's last-resort handler already answered when it could
            await out.put(exc)
        finally:
            await out.put(_END)

    task = asyncio.create_task(run())
    start = None
    try:
        while True:
            msg = await out.get()
            if msg is _END:
                break
            if isinstance(msg, BaseException):
                if start is None:
                    raise msg
                break  # mid-response: the body ends here (the app logged it under the request id)
            if msg["type"] == "http.response.start":
                start = {"status": int(msg["status"]),
                         "headers": [(bytes(k), bytes(v)) for k, v in msg.get("headers") or []], "body": b""}
                continue
            if msg["type"] != "http.response.body":
                continue
            chunk = bytes(msg.get("body", b""))
            more = bool(msg.get("more_body", False))
            if start is not None and not start.get("sent"):
                start["body"] += chunk
                if chunk or not more:
                    start["sent"] = True
                    yield {k: v for k, v in start.items() if k != "sent"}
            elif chunk:
                yield chunk
            if not more:
                break
        if start is not None and not start.get("sent"):  # a start without a body message
            yield {k: v for k, v in start.items() if k != "sent"}
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
