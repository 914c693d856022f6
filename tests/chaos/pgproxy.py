"""A PostgreSQL-aware TCP proxy that cuts a worker's database connection at a chosen statement.

``tests/chaos/hosts.py``'s ``Forwarder`` copies bytes and can only be stopped at a moment the
test picks, which races with what the worker is doing. This proxy reads the client's side of
the PostgreSQL wire protocol (v3: a startup packet, then ``type byte + int32 length +
payload`` frames) far enough to see each statement's SQL (a simple ``Query``, an extended
``Parse``, or the ``Bind`` that runs a statement prepared earlier on the connection), and the
server's side far enough to see where each reply ends (``ReadyForQuery``).
An armed ``Cut`` fires on the first statement it matches:

``before``
    the statement is not forwarded; both sockets are closed. In a transaction, the server
    sees the client vanish and rolls the transaction back (a COMMIT that never arrived).
``after``
    the statement is forwarded and the server's reply is read up to its ``ReadyForQuery``
    but not relayed; then both sockets are closed. The server has executed (and, for a
    COMMIT or an autocommit statement, committed) it; the client only sees its connection
    drop: an in-doubt commit.
``outage``
    as ``before``, and the whole proxy goes down with it: every open connection is dropped
    and new ones are refused (the listening socket is closed) until ``up()``, on the same
    port. The database is unreachable from the worker, from the moment it sent that
    statement.

A ``Cut`` may be ``primed_by`` another pattern: it then fires only on a connection whose
earlier statement matched that one (say the COMMIT that follows the success mark).

An ``SSLRequest`` (or ``GSSENCRequest``) is answered ``N`` by the proxy itself, so the
session stays in clear text and readable. Every statement seen is logged in ``statements``
(the tests check that psycopg sends COMMIT as a simple query). The proxy runs an asyncio loop
in a daemon thread; ``stop()`` closes everything it opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
import threading
import time
from dataclasses import dataclass, field

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102


@dataclass
class Cut:
    """Drop a connection at the first statement matching ``pattern`` (see the module doc)."""

    pattern: str
    when: str = "after"  # "before" | "after" | "outage"
    primed_by: str = ""
    fired_at: float | None = None  # time.monotonic() when it fired
    statement: str = ""  # the SQL it fired on
    kind: str = ""  # the message that carried it: "Q" (simple query), "P" (Parse) or "B" (Bind of a prepared one)
    server_reply: list[str] = field(default_factory=list)  # what the server said (not relayed)
    fired: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.when not in {"before", "after", "outage"}:
            raise ValueError(f"unknown cut {self.when!r}")


@dataclass
class Statement:
    at: float
    connection: int
    kind: str  # "Q" (simple query), "P" (Parse, extended protocol) or "B" (Bind of a prepared statement)
    sql: str


class _Conn:
    """One proxied client connection."""

    def __init__(self, number: int, client: asyncio.StreamWriter) -> None:
        self.number = number
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.primed = False
        self.swallowing: Cut | None = None  # set after an "after" cut: the server's reply is discarded
        self.prepared: dict[bytes, str] = {}  # a prepared statement's name -> its SQL (from its Parse)

    def abort(self) -> None:
        for writer in (self.client, self.server):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.transport.abort()


class PgProxy:
    """``listen_host:port`` -> ``target_host:target_port`` (PostgreSQL), with armed cuts."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1", port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.port = port
        self.statements: list[Statement] = []
        self.cuts: list[Cut] = []
        self.connections_made = 0
        self.down_since: float | None = None
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None

    # --- control (from the test's thread) ----------------------------------------------------

    def start(self) -> PgProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._listen())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"pgproxy-{self.target_port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the PostgreSQL proxy did not start")
        return self

    def arm(self, cut: Cut) -> Cut:
        with self._lock:
            self.cuts.append(cut)
        return cut

    @property
    def is_down(self) -> bool:
        return self.down_since is not None

    def down(self) -> None:
        """Refuse new connections and drop the open ones (the database went away)."""
        self._call(self._down())

    def up(self) -> None:
        """Listen again, on the same port."""
        self._call(self._up())

    def stop(self) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._thread = None

    def sql_seen(self, pattern: str) -> list[Statement]:
        with self._lock:
            return [s for s in self.statements if re.search(pattern, s.sql)]

    def _call(self, coro: object) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    # --- the loop's side -----------------------------------------------------------------------

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.down_since is None:
            self.down_since = time.monotonic()
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()

    async def _shutdown(self) -> None:
        await self._down()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _up(self) -> None:
        if self._server is None:
            await self._listen()
        self.down_since = None

    def _match(self, conn: _Conn, kind: str, sql: str) -> Cut | None:
        with self._lock:
            for cut in self.cuts:
                if cut.fired.is_set():
                    continue
                if cut.primed_by and not conn.primed and re.search(cut.primed_by, sql):
                    conn.primed = True
                    continue
                if cut.primed_by and not conn.primed:
                    continue
                if re.search(cut.pattern, sql):
                    cut.fired_at = time.monotonic()
                    cut.statement, cut.kind = sql, kind
                    return cut
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_made += 1
        conn = _Conn(self.connections_made, writer)
        self._conns.add(conn)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            self._conns.discard(conn)
            return
        conn.server = up_writer
        downstream = asyncio.ensure_future(self._server_to_client(conn, up_reader))
        try:
            await self._client_to_server(conn, reader, up_writer)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            if conn.swallowing is None:  # an "after" cut closes when the server's reply is read
                conn.abort()
                downstream.cancel()
            self._conns.discard(conn)

    async def _client_to_server(self, conn: _Conn, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        # Startup phase: untyped packets (int32 length including itself, int32 code, ...).
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            rest = await reader.readexactly(length - 8)
            if code in (SSL_REQUEST, GSSENC_REQUEST):
                conn.client.write(b"N")  # no encryption: the session must stay readable
                await conn.client.drain()
                continue
            up.write(head + rest)
            await up.drain()
            if code == CANCEL_REQUEST:
                return
            break
        # Typed frames: 1 byte type, int32 length (including itself), payload.
        while True:
            head = await reader.readexactly(5)
            kind = chr(head[0])
            (length,) = struct.unpack("!i", head[1:])
            payload = await reader.readexactly(length - 4)
            cut: Cut | None = None
            sql = None
            if kind == "Q":
                sql = payload[:-1].decode(errors="replace")
            elif kind == "P":  # Parse: statement name NUL, query NUL, parameter types
                name, query, _rest = payload.split(b"\0", 2)
                sql = query.decode(errors="replace")
                if name:  # a prepared statement: seen (and cut) where it is run, at each Bind
                    conn.prepared[name] = sql
                    sql = None
            elif kind == "B":  # Bind: portal name NUL, statement name NUL, ...
                _portal, name, _rest = payload.split(b"\0", 2)
                sql = conn.prepared.get(name) if name else None
            if sql is not None and conn.swallowing is None:
                with self._lock:
                    self.statements.append(Statement(time.monotonic(), conn.number, kind, sql))
                cut = self._match(conn, kind, sql)
            if cut is not None and cut.when in ("before", "outage"):
                cut.fired.set()
                if cut.when == "outage":
                    await self._down()
                conn.abort()
                return
            up.write(head + payload)
            await up.drain()
            if cut is not None:  # "after": the server runs it; its reply is swallowed
                conn.swallowing = cut

    async def _server_to_client(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                head = await reader.readexactly(5)
                kind = chr(head[0])
                (length,) = struct.unpack("!i", head[1:])
                payload = await reader.readexactly(length - 4)
                cut = conn.swallowing
                if cut is None:
                    conn.client.write(head + payload)
                    await conn.client.drain()
                    continue
                if kind in ("C", "E"):  # CommandComplete's tag, or an ErrorResponse
                    cut.server_reply.append(f"{kind}:{payload[:-1].decode(errors='replace')}")
                if kind == "Z":  # the server has finished the statement: now the client loses it
                    cut.server_reply.append(f"Z:{payload.decode(errors='replace')}")
                    conn.abort()
                    cut.fired.set()
                    return
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            conn.abort()
