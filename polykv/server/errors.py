"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

`ERROR_TABLE` is the one place where polykv's typed errors (`polykv/errors.py`) become HTTP statuses.
Nothing is classified by message text or class name. Any other exception is a bug: the client gets a
500 whose body says only "internal error" and the request id (no internal text), and the log gets the
traceback under the same id (`X-Request-ID` header on every response).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (BudgetExceededError, DocumentInUseError, EngineClosedError, InvalidRequestError, QueueFullError,
                      UnknownDocumentError)

__all__ = ["APIError", "ERROR_TABLE", "RETRY_AFTER_S", "TYPED", "error_body", "install_error_handlers", "internal_error",
           "to_api_error"]

log = logging.getLogger("polykv.server")

RETRY_AFTER_S = 2  # Retry-After of every 429

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI: 401 {"type": "invalid_request_error", "code": "invalid_api_key"}
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if request_id:
            headers.setdefault("X-Request-ID", request_id)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Rule:
    status: int
    code: str
    message: Callable[[Exception], str] = str  # the client's text (typed errors carry our own words)
    retry: bool = False  # send Retry-After


ERROR_TABLE: dict[type[Exception], Rule] = {
    UnknownDocumentError: Rule(404, "document_not_found",
                               lambda e: f"Unknown document {getattr(e, 'document', None)!r}"),
    DocumentInUseError: Rule(409, "document_in_use"),
    BudgetExceededError: Rule(429, "kv_budget_exceeded", lambda e: f"KV memory budget exceeded: {e}", retry=True),
    QueueFullError: Rule(429, "queue_full", lambda e: f"server busy: {e}", retry=True),
    InvalidRequestError: Rule(400, "invalid_value"),
    EngineClosedError: Rule(503, "shutting_down", lambda e: "server is shutting down"),
}


TYPED = tuple(ERROR_TABLE)  # `except TYPED` in a route: a typed error, mapped with the route's param


def _rule(exc: BaseException) -> Rule | None:
    for cls in type(exc).__mro__:  # the most specific class in the table wins
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return None


def internal_error(request_id: str | None, exc: BaseException | None = None) -> APIError:
    """The generic 500: logs the traceback under the request id; no internal text to the client."""
    if exc is not None:
        log.error("internal error in request %s: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
    return APIError(500, f"Internal server error (request id {request_id}); the details are in the server log.",
                    code="internal_error", headers={"X-Request-ID": request_id} if request_id else None)


def to_api_error(exc: BaseException, request_id: str | None, param: str | None = None) -> APIError:
    """APIError as is; a typed polykv error through ERROR_TABLE; anything else: `internal_error`."""
    if isinstance(exc, APIError):
        return exc
    rule = _rule(exc)
    if rule is None:
        return internal_error(request_id, exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if rule.retry else None
    return APIError(rule.status, rule.message(exc) or rule.code, param=param, code=rule.code, headers=headers)


def request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


_SIMPLE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
_KINDS = {str: "str", int: "int", float: "float", bool: "bool", list: "list", dict: "dict", type(None): "none"}


def _is_tag(part) -> bool:
    """A union member's tag that pydantic puts in an error's location ('int', 'list[int]',
    'function-after[_unicode(), str]'), not a field name or a list index."""
    return isinstance(part, str) and ("[" in part or part in _SIMPLE_TAGS)


def _tag_kind(tag: str) -> str:
    """The JSON type a union member takes: 'function-after[_unicode(), str]' -> 'str', 'list[int]' -> 'list'."""
    while tag.startswith("function-") and "()," in tag:
        tag = tag[tag.index("(),") + 3:].strip()[:-1]
    return tag.split("[", 1)[0]


def _loc_param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header") and not _is_tag(p)]
    return ".".join(parts) or None


def _message(err: dict) -> str:
    return err.get("msg", "invalid request").removeprefix("Value error, ")


def validation_problems(errs: list[dict]) -> list[tuple[str | None, str]]:
    """(param, message) per problem of a pydantic error list, in order.

    pydantic reports a union-typed field (``stop: str | list[str]``) once per member, each under the
    member's tag ("stop.str: should be a valid string" for a list of 5 stops): the members are
    grouped back into one problem of the field, told by the member of the value's own JSON type (a
    list's "at most 4 items"), or, when the value fits none, as one message naming every member's
    expectation ("should be a valid integer or a valid number")."""
    groups: dict[tuple, list[dict]] = {}
    for err in errs:
        loc = tuple(err.get("loc", ()))
        cut = next((i for i, p in enumerate(loc) if _is_tag(p)), None)
        key = loc[:cut] if cut is not None else loc + (id(err),)
        groups.setdefault(key, []).append(err)
    problems = []
    for key, group in groups.items():
        tagged = [e for e in group if any(_is_tag(p) for p in e.get("loc", ()))]
        if not tagged:
            problems += [(_loc_param(e.get("loc", ())), _message(e)) for e in group]
            continue
        depth = len(key) + 1  # an error at the member's own level holds the field's value as its input
        value = next((e.get("input") for e in tagged if len(e["loc"]) == depth), None)
        kind = _KINDS.get(type(value))
        member = {id(e): _tag_kind(e["loc"][len(key)]) for e in tagged}
        fitting = [e for e in tagged if member[id(e)] == kind]
        if fitting:
            problems += [(_loc_param(e["loc"]), _message(e)) for e in fitting]
            continue
        wants = list(dict.fromkeys(_message(e) for e in tagged))
        head = "Input should be "
        msg = head + " or ".join(w.removeprefix(head) for w in wants) if all(w.startswith(head) for w in wants) \
            else "; or ".join(wants)
        problems.append((_loc_param(key), msg))
    return problems


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response(request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        if errs and errs[0].get("type") == "json_invalid":
            return APIError(400, "Could not parse the request body as JSON.", code="invalid_json").response()
        problems = validation_problems(errs) or [(None, "invalid request")]
        param, msg = problems[0]
        if len(problems) > 1:
            msg += f" (and {len(problems) - 1} more problem(s))"
        where = f" at '{param}'" if param else ""
        return APIError(400, f"Invalid request{where}: {msg}", param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        if status == 404:
            msg = f"Unknown URL: {request.method} {request.url.path}"
        elif status == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
        return APIError(status, msg, headers=getattr(exc, "headers", None)).response()

    for cls in ERROR_TABLE:  # typed errors that reach the app unmapped (no param known)
        app.add_exception_handler(cls, _typed)


async def _typed(request: Request, exc: Exception):
    return to_api_error(exc, request_id(request)).response(request_id(request))
