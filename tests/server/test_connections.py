"""Per-connection limits (kiln/server/connections.py) on a real uvicorn socket over a small ASGI app: a connection
that sends no request, or trickles its headers a few bytes at a time, gets 408 and is closed once --header-timeout
has passed; a slow response or a kept-alive connection's next request is not cut; headers over MAX_HEADER_BYTES
are a 400; idle connections are closed to make room, and a connection beyond --max-connections whose others all
have a request in flight is a 503 (tests/server/test_idle_connections.py). No model: each test takes a few
seconds."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from kiln.server.connection_table import ConnectionTable
from kiln.server.connections import http_config
from kiln.server.limits import MAX_HEADER_BYTES
from kiln.server.server_args import ServerArgs

HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 6
FLOOD_SENT: list[int] = []  # bytes /flood has sent, after each chunk


async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
    """200 "ok"; the path /slow answers after 2 x HEADER_TIMEOUT; /flood streams 16 MiB."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * HEADER_TIMEOUT)
    if scope["path"] == "/flood":  # 16 MiB in 64 KiB chunks, recording how much was handed to the server so far
        await send({"type": "http.response.start", "status": 200, "headers": []})
        FLOOD_SENT.append(0)
        for _ in range(256):
            await send({"type": "http.response.body", "body": b"z" * 65536, "more_body": True})
            FLOOD_SENT.append(FLOOD_SENT[-1] + 65536)
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    table = ConnectionTable(MAX_CONNECTIONS, MAX_CONNECTIONS)
    config = http_config(
        app,
        "127.0.0.1",
        0,
        header_timeout=HEADER_TIMEOUT,
        keep_alive_timeout=30,
        connections=table,
        log_config=None,
        lifespan="off",
    )
    yield from serving(config)


def serving(config: uvicorn.Config) -> Iterator[int]:
    """Run a uvicorn server of `config` on a thread; yield its port; stop it."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def answer_within(port: int, status_line: bytes, deadline_s: float = 10.0) -> bool:
    """Whether a request on a new connection is answered `status_line` within `deadline_s` (asked again and again)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with connect(port) as sock:
            sock.sendall(request())
            if sock.recv(65536).startswith(status_line):
                return True
        time.sleep(0.05)
    return False


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def request(path: str = "/") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def test_a_silent_connection_gets_408_after_the_header_timeout(port: int) -> None:
    started = time.monotonic()
    with connect(port) as sock:
        answer = read_answer(sock)
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 ") and HEADER_TIMEOUT <= waited < HEADER_TIMEOUT + 2
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "header_timeout" and "--header-timeout" in body["error"]["message"]


def test_trickled_headers_do_not_extend_the_deadline(port: int) -> None:
    started = time.monotonic()
    with connect(port) as sock:
        for byte in b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ":
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed by the server: the deadline passed
                break
            time.sleep(0.1)
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < HEADER_TIMEOUT + 2


def test_a_slow_response_and_the_next_request_on_the_connection_are_served(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request("/slow"))  # its response takes twice the header timeout
        first = b""
        while not first.endswith(b"ok"):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(request() + request())  # two pipelined requests on the kept-alive connection
        answers = b""
        while answers.count(b"HTTP/1.1 200 ") < 2 or not answers.endswith(b"ok"):
            answers += sock.recv(65536)
        assert b"408" not in answers
        started = time.monotonic()
        assert read_answer(sock).startswith(b"HTTP/1.1 408 ")  # idle after its last answer: the deadline again
        assert time.monotonic() - started < HEADER_TIMEOUT + 2


def test_oversized_headers_are_refused(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n")
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"200" not in answer  # whole or in pieces: never served
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(MAX_HEADER_BYTES // 1000 + 1):
            sock.sendall(b"X-Part: " + b"b" * 990 + b"\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 431 ")


def test_a_connection_beyond_the_limit_closes_the_oldest_idle_one(port: int) -> None:
    idle = [connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        # the server counts a connection once its loop has accepted it: polled, not waited for
        assert answer_within(port, b"HTTP/1.1 200 ")  # before issue 51: a 503, as every request on any connection
        assert read_answer(idle[0]) == b""  # the oldest silent connection was closed, without an answer
    finally:
        for sock in idle:
            sock.close()


def test_a_client_that_stops_reading_holds_back_the_sender_within_a_fixed_buffer(port: int) -> None:
    """The app streams 16 MiB to a client that reads nothing: its sends block once the fixed kernel buffers and
    the transport's are full (under 2 MiB on loopback), where Linux's autotuned send buffer would take ~4 MiB."""
    with connect(port) as sock:
        sock.sendall(request("/flood"))
        held = settled(FLOOD_SENT)  # the sender is blocked: nothing more handed to the server for a while
        assert 0 < held < 2 * 2**20, held
        received = 0
        tail = b""
        while not tail.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk: the sender got to its end
            chunk = sock.recv(1 << 20)
            assert chunk, "the server closed the connection before the flood ended"
            received += len(chunk)
            tail = (tail + chunk)[-16:]
    assert FLOOD_SENT[-1] == 16 * 2**20 <= received  # held back, not cut off: reading let it go on


def settled(sent: list[int], quiet_s: float = 0.5, deadline_s: float = 30.0) -> int:
    """The last of `sent` once it has not grown for `quiet_s` (polled until `deadline_s`)."""
    deadline = time.monotonic() + deadline_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = sent[-1] if sent else 0
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.05)
    raise AssertionError(f"the sender never stopped: {last} bytes after {deadline_s} s")


def test_keep_alive_timeout_closes_an_idle_kept_alive_connection() -> None:
    """`kiln serve --keep-alive-timeout 0.5`: a connection idle after its answer is closed (no 408: the header
    timeout is 30 s here) after about that long, and not before."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--keep-alive-timeout", "0.5"])
    config = http_config(
        app, "127.0.0.1", 0, header_timeout=30, keep_alive_timeout=args.keep_alive_timeout, log_config=None
    )
    for port in serving(config):
        with connect(port) as sock:
            sock.sendall(request())
            answered = b""
            while not answered.endswith(b"ok"):
                answered += sock.recv(65536)
            idle_since = time.monotonic()
            assert answered.startswith(b"HTTP/1.1 200 ")
            assert read_answer(sock) == b""  # closed without a word
            idle = time.monotonic() - idle_since
        assert 0.4 <= idle < 10, idle
