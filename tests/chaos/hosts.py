"""Real test hosts for network faults: network namespaces joined to this machine by veth pairs.

A ``TestHost`` is a network namespace with its own interface and address (``10.213.<n>.2``),
linked to this machine's namespace (``10.213.<n>.1``) by a veth pair. Processes started in
it (``host.command(...)``) reach the machine's services only through ``Forwarder``s that
listen on the host side of the link, so cutting or delaying the link is a real network
fault for those processes and nobody else: ``cut()`` drops every packet both ways (``tc
netem loss 100%``, so sockets hang as in a partition, nothing is reset), ``delay()`` adds
latency, ``heal()`` restores the link. Everything is named after this process's pid, and
``destroy()`` removes exactly what ``create()`` made.

Root is required. In CI (``CI=true``) a machine where namespaces cannot be made fails the
test instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import threading
from dataclasses import dataclass, field

#: The test hosts' addresses: one /16 per pytest-xdist process, so that two processes' hosts
#: never share a link address (``make test`` runs the suite in two).
SUBNET = f"10.{213 + int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0').removeprefix('gw') or 0)}"
#: The legacy iptables front end: this kernel has x_tables (``/proc/net/ip_tables_names``).
IPTABLES = "iptables-legacy"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


def namespaces_available() -> str:
    """Empty if this process can make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tpprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass
class TestHost:
    """One network namespace with a veth link to this machine."""

    index: int
    namespace: str = ""
    host_if: str = ""
    guest_if: str = ""
    created: bool = False

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}x{self.index}"
        self.namespace = f"tp{tag}"
        self.host_if = f"tph{tag}"[:15]
        self.guest_if = f"tpg{tag}"[:15]

    @property
    def gateway(self) -> str:
        """This machine's address on the link: where forwarders listen."""
        return f"{SUBNET}.{self.index}.1"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}.2"

    def create(self) -> TestHost:
        _ip("netns", "add", self.namespace)
        self.created = True
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.guest_if)
        _ip("link", "set", self.guest_if, "netns", self.namespace)
        _ip("addr", "add", f"{self.gateway}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        self.exec_ip("addr", "add", f"{self.address}/30", "dev", self.guest_if)
        self.exec_ip("link", "set", self.guest_if, "up")
        self.exec_ip("link", "set", "lo", "up")
        return self

    def exec_ip(self, *args: str) -> None:
        _ip("netns", "exec", self.namespace, "ip", *args)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def _iptables(self, *rule: str) -> None:
        """Add a rule to this host's own firewall (its namespace's tables; the machine's are untouched)."""
        subprocess.run(
            ["ip", "netns", "exec", self.namespace, IPTABLES, "-w", "-I", *rule],
            check=True,
            capture_output=True,
            timeout=10,
        )

    def cut(self) -> None:
        """Drop every packet to and from the machine, silently: established connections hang
        (nothing is reset), new ones time out. As a partition looks to this host."""
        self._iptables("OUTPUT", "-d", self.gateway, "-j", "DROP")
        self._iptables("INPUT", "-s", self.gateway, "-j", "DROP")

    def cut_port(self, port: int) -> None:
        """Drop, silently and both ways, the packets of one service (its forwarder's port)."""
        self._iptables("OUTPUT", "-p", "tcp", "-d", self.gateway, "--dport", str(port), "-j", "DROP")
        self._iptables("INPUT", "-p", "tcp", "-s", self.gateway, "--sport", str(port), "-j", "DROP")

    def lose(self, probability: float) -> None:
        """Drop this fraction of packets both ways, at random (a lossy link: TCP retransmits)."""
        for chain, side in (("OUTPUT", "-d"), ("INPUT", "-s")):
            self._iptables(chain, side, self.gateway, "-m", "statistic", "--mode", "random",
                           "--probability", f"{probability:.3f}", "-j", "DROP")  # fmt: skip

    def heal(self) -> None:
        """Remove every fault rule: the link carries everything again."""
        if self.created:
            subprocess.run(
                ["ip", "netns", "exec", self.namespace, IPTABLES, "-w", "-F"], capture_output=True, timeout=10
            )

    def destroy(self) -> None:
        if not self.created:
            return
        _ip("link", "del", self.host_if, check=False)  # removes both ends of the pair
        _ip("netns", "del", self.namespace, check=False)
        self.created = False


@dataclass
class Forwarder:
    """A TCP forwarder on this machine: ``listen_host:port`` -> ``target`` (a local service).

    Runs an asyncio loop in a daemon thread. Test hosts reach PostgreSQL, Redis and the other
    services (which listen on loopback only) through it, across their veth link.
    """

    listen_host: str
    target_host: str
    target_port: int
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.base_events.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self) -> Forwarder:
        ready = threading.Event()

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
            except OSError:
                writer.close()
                return
            for coro in (pipe(reader, up_writer), pipe(up_reader, writer)):
                task = asyncio.ensure_future(coro)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        async def serve() -> None:
            self._server = await asyncio.start_server(handle, self.listen_host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            await self._server.serve_forever()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(serve())

        self._thread = threading.Thread(target=run, name=f"forward-{self.target_port}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"forwarder to {self.target_host}:{self.target_port} did not start")
        return self

    def stop(self) -> None:
        """Refuse new connections and drop the open ones (``start()`` again reopens the port)."""
        if self._loop is None or self._server is None:
            return
        loop, server = self._loop, self._server

        def shutdown() -> None:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            for task in asyncio.all_tasks(loop):
                task.cancel()

        loop.call_soon_threadsafe(shutdown)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop = self._server = self._thread = None


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
