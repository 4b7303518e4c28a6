"""Idle connections cannot deny service (issue 51): uvicorn's limit answered 503 to every request while
--max-connections sockets were open, so 1,000 silent sockets refused every client. Now a new connection closes the
connection idle longest (of its own address first, past --max-connections-per-peer), a connection with a request in
flight is never closed, a new connection is refused only when every other has a request in flight, and every
refusal is counted in /metrics. On real uvicorn sockets over a small ASGI app, and the kiln app's /metrics."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from kiln.server.connection_table import ConnectionTable
from kiln.server.connections import http_config
from kiln.server.limits import MAX_CONNECTIONS
from tests.server.app_harness import Served, serve
from tests.server.fake_core import FakeCore
from tests.server.test_connections import serving

SLOW_S = 1.5


class Conn:
    def __init__(self) -> None:
        self.closed = False

    def close_idle(self) -> None:
        self.closed = True


def test_the_table_closes_the_oldest_idle_connection_and_never_a_busy_one() -> None:
    table = ConnectionTable(max_connections=3, max_per_peer=2)
    a, b, c = Conn(), Conn(), Conn()
    assert table.admit(a, "1.1.1.1") is None and table.admit(b, "2.2.2.2") is None
    table.busy(a)
    assert table.admit(c, "1.1.1.1") is None and len(table) == 3
    table.busy(c)
    d = Conn()
    assert table.admit(d, "3.3.3.3") is None and b.closed and not a.closed  # b was the only idle one
    table.busy(d)
    assert table.admit(Conn(), "4.4.4.4") == "max_connections"  # every one has a request in flight
    table.remove(a)
    e = Conn()
    assert table.admit(e, "1.1.1.1") is None  # a's place
    table.busy(e)
    assert table.admit(Conn(), "1.1.1.1") == "max_connections_per_peer"  # its 2 both busy
    table.idle(c)
    assert table.admit(Conn(), "1.1.1.1") is None and c.closed  # its own idle one makes room
    assert dict(table.num_refused) == {"max_connections": 1, "max_connections_per_peer": 1}
    assert table.num_closed_idle == 2


async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
    """200 "ok"; /slow answers after SLOW_S."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def running(table: ConnectionTable) -> Iterator[int]:
    config = http_config(
        app, "127.0.0.1", 0, header_timeout=10, keep_alive_timeout=5, connections=table, log_config=None, lifespan="off"
    )
    yield from serving(config)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def get(port: int, path: str = "/") -> bytes:
    with connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_1000_silent_sockets_leave_other_clients_served() -> None:
    table = ConnectionTable(MAX_CONNECTIONS, MAX_CONNECTIONS // 2)  # kiln serve's defaults
    with running(table) as port, ExitStack() as silent:
        for i in range(MAX_CONNECTIONS):  # two attacking addresses, each at its own cap
            silent.enter_context(connect(port, "127.0.0.2" if i % 2 else "127.0.0.3"))
        deadline = time.monotonic() + 20
        while len(table) < MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(table) == MAX_CONNECTIONS
        answers = [get(port) for _ in range(24)]  # before issue 51: 24 x 503
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        assert table.num_closed_idle >= 1 and not table.num_refused  # the first made room; each closes after
        assert len(table) >= MAX_CONNECTIONS - 1


def test_connections_with_requests_in_flight_are_never_refused_or_closed() -> None:
    table = ConnectionTable(max_connections=3, max_per_peer=4)
    with running(table) as port:
        results: list[bytes] = []
        busy = [threading.Thread(target=lambda: results.append(get(port, "/slow"))) for _ in range(3)]
        for thread in busy:
            thread.start()
        deadline = time.monotonic() + 10
        while (len(table) < 3 or table.num_idle) and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = get(port)
        for thread in busy:
            thread.join(10)
        assert refused.startswith(b"HTTP/1.1 503 ") and b"--max-connections" in refused
        assert len(results) == 3 and all(r.startswith(b"HTTP/1.1 200 ") for r in results)
        assert table.num_refused["max_connections"] == 1
        assert get(port).startswith(b"HTTP/1.1 200 ")  # served again once they are done


@pytest.mark.parametrize("reason", ["max_connections", "max_connections_per_peer"])
def test_refused_connections_are_counted_in_metrics(reason: str) -> None:
    async def body(s: Served) -> None:
        table: ConnectionTable = s.app.state.connections  # what the server's protocol admits connections through
        first = Conn()
        assert table.admit(first, "10.0.0.1") is None
        table.busy(first)
        assert table.admit(Conn(), "10.0.0.1" if reason.endswith("peer") else "10.0.0.2") == reason
        text = (await s.client.get("/metrics")).text
        assert f'kiln_connections_refused_total{{reason="{reason}"}} 1.0' in text
        assert "kiln_connections_open 1.0" in text

    serve(FakeCore(), body, ["--max-connections", "1", "--max-connections-per-peer", "1"])
