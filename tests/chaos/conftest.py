"""Fixtures for the fault catalogue: test hosts in network namespaces, with forwarders to the
machine's services, and processes with a skewed clock (libfaketime)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.chaos.hosts import Forwarder, TestHost, namespaces_available
from tests.conftest import IN_CI, broker_url, test_database_url


def _require(reason: str) -> None:
    if not reason:
        return
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the fault catalogue must run, not skip)")
    pytest.skip(reason)


def _through(url: str, forwarder: Forwarder) -> str:
    """``url`` with its host and port replaced by the forwarder's listening address."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    auth = f"{netloc[0]}@" if len(netloc) == 2 else ""
    return urlunsplit(parts._replace(netloc=f"{auth}{forwarder.listen_host}:{forwarder.port}"))


@dataclass
class RemoteHost:
    """A test host whose processes reach PostgreSQL and the broker only across its own link."""

    host: TestHost
    database: Forwarder
    broker: Forwarder
    forwarders: list[Forwarder] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """Environment for a Celery process on this host (settings read these URLs)."""
        return {
            "DATABASE_URL": _through(test_database_url(), self.database),
            "CELERY_BROKER_URL": _through(broker_url(), self.broker),
        }

    @property
    def prefix(self) -> list[str]:
        return self.host.command([])

    def cut(self) -> None:
        self.host.cut()

    def heal(self) -> None:
        self.host.heal()


@pytest.fixture
def remote_host(transactional_db: None) -> Iterator[RemoteHost]:
    """One test host (network namespace + veth) with forwarders to PostgreSQL and Redis.

    Removed afterwards: the forwarders stop, the link and the namespace are deleted.
    """
    if not test_database_url().startswith("postgres"):
        pytest.skip("the network fault tests run on PostgreSQL")
    _require(namespaces_available())
    host = TestHost(index=1)
    forwarders: list[Forwarder] = []
    try:
        host.create()
        database_target = urlsplit(test_database_url())
        broker_target = urlsplit(broker_url())
        database = Forwarder(host.gateway, database_target.hostname or "127.0.0.1", database_target.port or 5432)
        broker = Forwarder(host.gateway, broker_target.hostname or "127.0.0.1", broker_target.port or 6379)
        forwarders += [database.start(), broker.start()]
        yield RemoteHost(host=host, database=database, broker=broker, forwarders=forwarders)
    finally:
        host.heal()
        for forwarder in forwarders:
            forwarder.stop()
        host.destroy()


@pytest.fixture
def faketime_lib() -> Path:
    """The libfaketime library to preload into a process whose clock a test skews.

    The one vendored by the ``libfaketime`` package on PyPI (pinned in requirements/test.txt),
    not Debian's 0.9.10: under that one, with the monotonic clock left real, Python 3.11's
    ``time.sleep`` fails with EINVAL (its ``clock_nanosleep`` wrapper), and with the monotonic
    clock faked every timed thread wait hangs, so a Celery worker cannot run under it.
    """
    import libfaketime

    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    _require("" if library.exists() else f"libfaketime's library is missing at {library}")
    return library
