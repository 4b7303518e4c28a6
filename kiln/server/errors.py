"""Every failure as OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Rules: the message says what was expected, what was found and what to do. A client never sees a traceback or
the text of an exception the server did not raise on purpose: those are answered with a 500 that carries the
HTTP request's id, under which the server log has the traceback (see kiln/server/middleware.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.engine.serving.request_stream import EngineStoppedError, QueueFullError
from kiln.errors import RequestError
from kiln.recipe.guards import RecipeViolation
from kiln.server.limits import LimitExceeded
from kiln.server.request_fields import refusal_reason

CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the answer (logs and metrics)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the server answers on purpose (unknown model, bad API key, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# Exceptions the server raises on purpose; anything else is a kiln bug, answered by `internal_error`.
EXPECTED_ERRORS: tuple[type[Exception], ...] = (APIError, RequestError, QueueFullError, EngineStoppedError)


def expected_error(exc: Exception) -> APIError | None:
    """The error a client gets for an exception the server raises on purpose; None for any other exception."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LimitExceeded):
        return APIError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, RecipeViolation):
        return APIError(400, str(exc), exc.param, "recipe_violation")
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), None, "queue_full", {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), None, "shutting_down")
    return None


def internal_error(request_id: str) -> APIError:
    """The answer to an unexpected exception: never its text, only the id the server logged its traceback under."""
    return APIError(
        500,
        f"internal server error in request {request_id}: this is a bug in kiln, not in the request; the server "
        "log has the details under that id (quote it when reporting)",
        code="internal_error",
    )


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's errors, and the first offending field as `param`."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "parse error")
        return f"the request body is not valid JSON ({detail}); send a JSON object", None
    if tuple(first.get("loc", ())) == ("body",):
        got = first.get("input")
        what = "not JSON (send Content-Type: application/json)" if isinstance(got, bytes | str) else _short(got)
        return f"the request body must be a JSON object with the request fields; got {what}", None
    parts = []
    for error in errors[:3]:
        field = _field(error.get("loc", ()))
        got = error.get("input")
        if error.get("type") == "extra_forbidden":  # a field the request models do not declare
            parts.append(f"{field}: {refusal_reason(field.rpartition('.')[2])}")
            continue
        found = "" if error.get("type") == "missing" else f" (got {_short(got)})"
        parts.append(f"{field or 'body'}: {error.get('msg', 'invalid')}{found}")
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, _field(first.get("loc", ())) or None


_BRANCH_TYPES = frozenset({"str", "int", "float", "bool", "none"})


def _field(loc: Any) -> str:
    """pydantic loc ('body', 'messages', 0, 'content') -> 'messages.0.content', dropping union-branch names."""
    names = [str(x) for x in loc if x != "body"]
    # NOTE: a branch is named by its type ("str", "list[int]"); a field named "stream" is not one
    keep = [n for n in names if n not in _BRANCH_TYPES and "[" not in n]
    return ".".join(keep)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; kiln serves /v1/completions, "
                "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /tokenizer_info, /health and /metrics"
            )
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    async def on_expected_error(_: Request, exc: Exception) -> JSONResponse:
        error = expected_error(exc)
        assert error is not None, f"{type(exc).__name__} is in EXPECTED_ERRORS but expected_error does not map it"
        return api_error_response(error)

    # NOTE: other exceptions have no handler here on purpose: they reach RequestIdMiddleware, which logs the
    # traceback under the request id and answers with `internal_error`.
    for error_class in EXPECTED_ERRORS:
        app.add_exception_handler(error_class, on_expected_error)


def api_error_response(error: APIError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code, error.headers)
