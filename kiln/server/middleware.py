"""What runs on every HTTP request before a route sees it: a request id, the Host check or the API key, the
body-size limit.

Order, outermost first (see `create_app`): RequestIdMiddleware, HTTP metrics, HostCheckMiddleware (no key) or
APIKeyMiddleware, BodySizeLimitMiddleware, then routing. So every answer carries an `x-request-id` header and is
counted in /metrics; a Host that is not this server's, or a request without the key, is refused before a byte of
its body is read; a body over the limit is refused before it is parsed; and only then does FastAPI parse JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import uuid

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server.errors import api_error_response, error_response, internal_error
from kiln.server.limits import BODY_TIMEOUT_S

logger = logging.getLogger("kiln")

REQUEST_ID_HEADER = "x-request-id"


def request_id_of(request: Request) -> str:
    """The id RequestIdMiddleware gave this HTTP request (`req-<32 hex digits>`)."""
    return request.state.request_id


class RequestIdMiddleware:
    """Gives every HTTP request an id, in `request.state.request_id` and the `x-request-id` response header, and
    answers an exception that no handler took with a 500 naming that id (never the exception's text); the
    server log has the traceback under the same id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        is_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
                headers = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s: %s %s failed", request_id, scope["method"], scope["path"])
            # NOTE: once the status line is out there is no way left to send an error; streaming responses send
            # theirs as an SSE event themselves (kiln/server/serving.py), so only a kiln bug ends up here.
            if not is_started:
                await api_error_response(internal_error(request_id))(scope, receive, send_with_id)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>` matches (constant-time compare), decided from the headers
    alone, before any body is read: on every path but /health (a load balancer's probe) and, unless
    `protect_metrics`, /metrics; /openapi.json and unknown paths included."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key):
            await self.app(scope, receive, send)
            return
        found = "no Authorization header" if not header else "a key that does not match"
        response = error_response(
            401,
            "invalid API key: expected 'Authorization: Bearer <key>' with the server's API key (--api-key, "
            f"--api-key-file or KILN_API_KEY), got {found}",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _is_protected(self, path: str) -> bool:
        if path == "/metrics":
            return self.protect_metrics
        return path != "/health"


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`: from Content-Length when the client sends one (nothing is read
    then), else by counting while the body arrives (reading stops past the limit). 408 for a body that has not
    arrived whole within `timeout_s` (a stalled or trickled upload holds memory and a connection otherwise); the
    server closes that connection. A body within the limits is read here and handed on to the app unchanged;
    nothing is parsed here."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(f"is {int(declared)} bytes (Content-Length)", scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                chunks.clear()
                await self._too_slow(size, scope, receive, send)
                return
            if message["type"] != "http.request":
                return  # http.disconnect: the client left while sending; nobody is left to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(f"has more than {self.max_bytes} bytes", scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        is_body_sent = False

        async def receive_body_then_rest() -> Message:
            nonlocal is_body_sent
            if is_body_sent:
                return await receive()  # http.disconnect, which serving.py waits for
            is_body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, receive_body_then_rest, send)

    async def _too_slow(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            408,
            f"the request body did not arrive within {self.timeout_s:g} s ({size} bytes came); this server waits "
            f"at most --body-timeout={self.timeout_s:g} s for a body; send it whole and promptly",
            code="body_timeout",
        )
        await response(scope, receive, send)

    async def _refuse(self, what: str, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"the request body {what}; this server accepts at most {self.max_bytes} bytes "
            f"(--max-body-bytes={self.max_bytes}); send a smaller request",
            code="body_too_large",
        )
        await response(scope, receive, send)


LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port, lower case ("[::1]:8000" -> "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheckMiddleware:
    """Without an API key, answers only requests whose Host names this server: an IP address, localhost, or a
    name in `allowed` ("*": any). A web page that rebinds its own domain to 127.0.0.1 (DNS rebinding) sends its
    domain as the Host, so it cannot drive a key-less server on loopback from a browser."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = frozenset(a.lower() for a in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "*" in self.allowed:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("host", "")
        name = host_name(header)
        if is_ip_literal(name) or name in LOCAL_NAMES or name in self.allowed:
            await self.app(scope, receive, send)
            return
        shown = header if len(header) <= 100 else header[:100] + "..."
        response = error_response(
            400,
            f"the Host header {shown!r} is not a name this server answers to without an API key (an IP address, "
            "localhost, or a name given with --allowed-hosts); start the server with --allowed-hosts NAME, or "
            "set an API key",
            code="host_not_allowed",
        )
        await response(scope, receive, send)
