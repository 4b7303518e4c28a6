"""Per-connection limits of `kiln serve`, where uvicorn's settings do not reach.

uvicorn (h11) bounds the size of a request's headers (`MAX_HEADER_BYTES`) and the idle time between requests on
a kept-alive connection (`--keep-alive-timeout`); kiln.server.connection_table bounds the connections, closing idle
ones before refusing a new one (uvicorn's own limit answered 503 to every request once that many were open). It puts no
time limit on the request line and headers themselves: a client that connects and sends nothing, or trickles a
header a byte at a time (slowloris), holds its connection and a file descriptor for ever. `HeaderTimeoutProtocol`
gives every request `--header-timeout` seconds from the moment the connection is ready for it (opened, or the
previous response sent) to the end of its headers, then answers 408 and closes, and bounds their size in pieces
as well as whole (431). Each connection's kernel send buffer is fixed at SEND_BUFFER_BYTES, so a client that stops
reading a stream is noticed (and cut off, kiln/engine/serving/request_stream.py) after about that much unread data, not
after the megabytes Linux would autotune it to. The body has its own timeout (`--body-timeout`,
kiln/server/middleware.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.server.connection_table import ConnectionTable
from kiln.server.limits import (
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_HEADER_BYTES,
    SEND_BUFFER_BYTES,
)

REFUSED_LINGER_S = 1.0
_FULL = {
    "max_connections": "the server has as many connections open as it serves (--max-connections), each with a "
    "request in flight; retry shortly",
    "max_connections_per_peer": "this address has as many connections open as one address may have "
    "(--max-connections-per-peer), each with a request in flight; reuse one, or retry shortly",
}


def _refusal(status: str, code: str, message: str, error_type: str = "invalid_request_error") -> bytes:
    """A whole HTTP answer with OpenAI's error body, written before uvicorn parsed a request."""
    error = {"message": message, "type": error_type, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {len(body)}"
    return f"{head}\r\n\r\n".encode() + body


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's line and headers (`header_timeout`)."""

    header_timeout: float = HEADER_TIMEOUT_S
    connection_table: ConnectionTable | None = None  # None: no connection limits (a test's protocol)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._cycle_before: object | None = None  # the cycle of the last request whose headers had arrived
        self._header_bytes = 0  # of the request being awaited, so far
        self._tail = b""  # the last bytes received while awaiting it (its end of headers may straddle two reads)
        self._is_turned_away = False  # refused when it opened (kiln.server.connection_table): its data is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # NOTE: a fixed send buffer instead of Linux's autotuned one (up to 4 MiB): a stream whose client
            # stops reading backs up into --max-stream-buffer after SEND_BUFFER_BYTES, not megabytes later
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)
        if self.connection_table is not None:
            peer = transport.get_extra_info("peername")
            refused = self.connection_table.admit(self, str(peer[0]) if peer else "unknown")
            if refused is not None:
                self._turn_away(_refusal("503 Service Unavailable", refused, _FULL[refused], "server_error"))
                return
        self._await_headers()

    def _turn_away(self, answer: bytes) -> None:
        """Answer a connection refused at its opening and end it gently: the client sends its request at once, and
        closing a socket with unread data resets it, which would drop the answer before the client reads it; so
        the write side is shut, what arrives is discarded, and the socket closes after REFUSED_LINGER_S."""
        self._is_turned_away = True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def close_idle(self) -> None:
        """Closed for room (kiln.server.connection_table): it awaits a request, so no answer is owed."""
        self._cancel_header_timer()
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._is_turned_away:
            return
        if self._header_timer is not None:  # awaiting a request's headers: bound their size, in pieces or whole
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += (end - len(self._tail) + 4) if end >= 0 else len(data)
            self._tail = seen[-3:]
            if self._header_bytes > MAX_HEADER_BYTES:
                message = f"the request line and headers are over {MAX_HEADER_BYTES} bytes"
                self._refuse(_refusal("431 Request Header Fields Too Large", "headers_too_large", message))
                return
        super().data_received(data)
        if self.cycle is not self._cycle_before:  # a new request's headers are complete: its cycle exists
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        # the next request on this kept-alive connection gets the same deadline; set before uvicorn starts a
        # pipelined request that already arrived (inside the call), which then cancels it below
        self._await_headers()
        super().on_response_complete()
        if self.transport.is_closing() or self.cycle is not self._cycle_before:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self.connection_table is not None:
            self.connection_table.remove(self)
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._cancel_header_timer()
        self._cycle_before = self.cycle
        self._header_bytes, self._tail = 0, b""
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)
        if self.connection_table is not None:
            self.connection_table.idle(self)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self.connection_table is not None:
            self.connection_table.busy(self)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.cycle is not self._cycle_before:
            return
        message = f"the request line and headers did not arrive within {self.header_timeout:g} s (--header-timeout)"
        self._refuse(_refusal("408 Request Timeout", "header_timeout", message))

    def _refuse(self, answer: bytes) -> None:
        self._cancel_header_timer()
        self.transport.write(answer)
        self.transport.close()


def http_config(
    app: Any,
    host: str,
    port: int,
    *,
    header_timeout: float = HEADER_TIMEOUT_S,
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S,
    connections: ConnectionTable | None = None,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's config for `app` with kiln's per-connection limits (`connections`: the open connections and their
    limits; None: MAX_CONNECTIONS, half of them per peer); `options` are passed through."""
    table = connections if connections is not None else ConnectionTable(MAX_CONNECTIONS, MAX_CONNECTIONS // 2)
    protocol = type(
        "KilnH11Protocol", (HeaderTimeoutProtocol,), {"header_timeout": header_timeout, "connection_table": table}
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=keep_alive_timeout,
        **options,
    )
