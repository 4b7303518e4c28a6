"""The open connections of `kiln serve`, so that idle ones cannot deny service to anyone.

uvicorn's `limit_concurrency` answered 503 to every request on every connection while `--max-connections` were
open, so 1,000 silent sockets (renewed under the header timeout) refused every client, and those 503s never reached
/metrics. Here each connection is either idle (awaiting a request's line and headers: just opened, trickling, or
kept alive after a response) or busy (a request in flight). A new connection over a limit first closes idle ones,
the oldest idle first: over `max_per_peer` its peer's own, over `max_connections` anyone's. Only when none is idle
is the new connection refused (503, counted by reason in /metrics). A connection with a request in flight is
never closed or refused here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Protocol


class Connection(Protocol):
    def close_idle(self) -> None:
        """Close this connection, which awaits a request (no response is owed)."""


class ConnectionTable:
    """Every open connection's peer, and which are idle, in the order they became idle (single event loop)."""

    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self._peer: dict[Connection, str] = {}
        self._num_per_peer: Counter[str] = Counter()
        self._idle: OrderedDict[Connection, None] = OrderedDict()
        self.num_refused: Counter[str] = Counter()  # by reason: "max_connections" | "max_connections_per_peer"
        self.num_closed_idle = 0  # idle connections closed to make room

    def __len__(self) -> int:
        return len(self._peer)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def admit(self, conn: Connection, peer: str) -> str | None:
        """Open `conn` from `peer` (idle), closing idle connections to make room; the reason it is refused (and
        not opened) when no idle connection could be closed."""
        if self._num_per_peer[peer] >= self.max_per_peer and not self._close_oldest_idle(peer):
            return self._refuse("max_connections_per_peer")
        if len(self._peer) >= self.max_connections and not self._close_oldest_idle(None):
            return self._refuse("max_connections")
        self._peer[conn] = peer
        self._num_per_peer[peer] += 1
        self._idle[conn] = None
        return None

    def idle(self, conn: Connection) -> None:
        """`conn` awaits its next request: it may be closed for room, after those idle longer."""
        if conn in self._peer:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def busy(self, conn: Connection) -> None:
        """`conn` has a request in flight: it is never closed for room."""
        self._idle.pop(conn, None)

    def remove(self, conn: Connection) -> None:
        """`conn` is closed (idempotent)."""
        self._idle.pop(conn, None)
        if (peer := self._peer.pop(conn, None)) is not None:
            self._num_per_peer[peer] -= 1
            if not self._num_per_peer[peer]:
                del self._num_per_peer[peer]

    def _close_oldest_idle(self, peer: str | None) -> bool:
        """Close the connection idle longest (of `peer`'s, when given); False when there is none."""
        victim = next((c for c in self._idle if peer is None or self._peer[c] == peer), None)
        if victim is None:
            return False
        self.remove(victim)
        self.num_closed_idle += 1
        victim.close_idle()
        return True

    def _refuse(self, reason: str) -> str:
        self.num_refused[reason] += 1
        return reason
