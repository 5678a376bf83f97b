"""Pure ASGI middlewares of the app (BaseHTTPMiddleware would break `request.is_disconnected()`).

Outermost first, as `create_app` stacks them: metrics (metrics.py) -> RequestContext (request id,
last-resort 500) -> ApiKeyAuth -> BodyLimit -> the routes.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid

from .errors import APIError, internal_error

__all__ = ["DEFAULT_MAX_BODY_BYTES", "OPEN_PATHS", "ApiKeyAuth", "BodyLimit", "RequestContext"]

log = logging.getLogger("polykv.server")

# A 128k-token document is about 0.5 MB of text; JSON escaping can double it.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

# Reachable without the API key: liveness, the status page's HTML (its data comes from /v1/status,
# which needs the key) and the API's own description.
OPEN_PATHS = frozenset({"/health", "/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


async def _send_error(send, err: APIError, request_id: str | None = None) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    if request_id and "x-request-id" not in {k.lower() for k in err.headers}:
        headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestContext:
    """Gives every request an id (the client's X-Request-ID when it is a short plain token, else a new
    one), stored in `scope["state"]["request_id"]` and sent back as X-Request-ID. An exception that
    escapes the app becomes the generic 500 (`errors.internal_error`: traceback logged under the id),
    or, once a response has started (a stream), is logged under the id and re-raised."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else "req-" + uuid.uuid4().hex[:20]
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                log.error("request %s failed mid-response: %s: %s", rid, type(exc).__name__, exc, exc_info=exc)
                raise
            await _send_error(send, internal_error(rid, exc), rid)


class ApiKeyAuth:
    """`Authorization: Bearer <key>` (as the OpenAI API) on every path but OPEN_PATHS; 401 otherwise."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        msg = ("Incorrect API key provided." if auth else "Missing API key.") + \
            " Send it as 'Authorization: Bearer <key>'."
        err = APIError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await _send_error(send, err, scope.get("state", {}).get("request_id"))


class BodyLimit:
    """413 for a request body over `max_bytes`: at once from Content-Length, or while reading a body
    sent without one (chunked), which is then replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    def _too_large(self, n: int | None) -> APIError:
        got = f" ({n} bytes)" if n is not None else ""
        return APIError(413, f"Request body too large{got}; this server accepts at most {self.max_bytes} bytes.",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = scope.get("state", {}).get("request_id")
        length = headers.get(b"content-length")
        if length is not None:
            n = int(length) if length.isdigit() else None
            if n is not None and n > self.max_bytes:
                return await _send_error(send, self._too_large(n), rid)
            return await self.app(scope, receive, send)  # the server holds the body to its length
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await _send_error(send, self._too_large(None), rid)
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replay_receive():
            for message in replay:
                return message
            return await receive()

        await self.app(scope, replay_receive, send)
