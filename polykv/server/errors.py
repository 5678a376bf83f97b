"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_body", "install_error_handlers"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
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

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _loc_param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return APIError(400, "Could not parse the request body as JSON.", code="invalid_json").response()
        param = _loc_param(first.get("loc", ()))
        msg = first.get("msg", "invalid request")
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more problem(s))"
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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # pragma: no cover - must not happen
        import logging

        logging.getLogger("polykv.server").exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
