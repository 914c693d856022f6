"""Shared fixtures: service checks, worker subprocesses, private Redis servers, polling.

Every process a test starts is started here, recorded by PID, and stopped here; a fault
test only ever signals processes it got from these fixtures.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import pytest

from tests.helpers import wait_for

pytest_plugins = ("tests.figures",)

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

#: Tests that run for minutes: collected first, so that under pytest-xdist one process starts
#: with them while the other works through the rest, instead of one of them running alone at
#: the end of the suite (CI's 20,000-execution soak takes 90-200 s, the rest at most 20 s each).
LONG_FIRST = ("tests/soak/",)


@pytest.hookimpl(trylast=True)  # after pytest-django's own ordering, which this keeps otherwise
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))


# --- services ----------------------------------------------------------------------------------


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip locally, fail loudly in CI, when a service a test needs is not reachable."""
    if port_open(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session", autouse=True)
def _database_service() -> None:
    """The suite's database must be up (PostgreSQL by default)."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return
    require_service(db["ENGINE"].rsplit(".", 1)[-1], db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432))


def broker_url() -> str:
    from django.conf import settings

    return str(settings.CELERY_BROKER_URL)


def redis_flushdb(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


# --- private redis-server ----------------------------------------------------------------------


@dataclass
class RedisServer:
    """A redis-server this test session started, on a free port; stopped by PID."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra,
            ],
            stdout=(self.workdir / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: port_open("127.0.0.1", self.port, 0.2), timeout=10, what=f"redis-server :{self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A throwaway redis-server, for tests that flush or stop their broker."""
    if not shutil_which("redis-server"):
        if IN_CI:
            pytest.fail("redis-server binary not on PATH")
        pytest.skip("redis-server binary not on PATH")
    server = RedisServer(port=free_port(), workdir=tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


# --- celery worker subprocesses ----------------------------------------------------------------


def test_database_url() -> str:
    """A URL for the database the test run is using (the test database, once created)."""
    from django.db import connection

    s = connection.settings_dict
    engine = s["ENGINE"]
    if engine.endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    scheme = {"postgresql": "postgres", "mysql": "mysql"}[engine.rsplit(".", 1)[-1]]
    user = quote(s.get("USER") or "")
    password = f":{quote(s['PASSWORD'])}" if s.get("PASSWORD") else ""
    return f"{scheme}://{user}{password}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or ''}/{s['NAME']}"


def celery_env(broker: str | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Celery process a test starts: test settings, database and broker."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": test_database_url(),
        "CELERY_BROKER_URL": broker or broker_url(),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }


@dataclass
class Worker:
    """A real ``celery worker`` (or ``celery beat``) process started by a test."""

    name: str
    proc: subprocess.Popen[bytes]
    logfile: Path
    env: dict[str, str] = field(default_factory=dict)
    terminated: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def pool_children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM (a warm shutdown), once: Celery may read a second one as a cold shutdown."""
        if not self.terminated and self.proc.poll() is None:
            self.terminated = True
            self.proc.terminate()

    def stop(self, timeout: float = 15) -> None:
        """Warm shutdown, then SIGKILL of the process group (only our own processes)."""
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class WorkerFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.workers: list[Worker] = []

    def start(
        self,
        *,
        broker: str | None = None,
        concurrency: int = 2,
        pool: str = "prefork",
        queues: str = "celery",
        env: dict[str, str] | None = None,
        wait: bool = True,
        command_prefix: list[str] | None = None,
        stdout: Path | None = None,
        extra_args: list[str] | None = None,
    ) -> Worker:
        """Start a worker; ``command_prefix`` wraps its command (e.g. a test host's ``ip netns exec``);
        ``stdout``: a file for its standard output (else discarded); ``extra_args``: more
        ``celery worker`` options."""
        name = f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:6]}"
        logfile = self.tmp_path / f"{name}.log"
        full_env = celery_env(broker, env)
        cmd = [
            sys.executable, "-m", "celery", "-A", "config", "worker",
            "-P", pool, "-c", str(concurrency), "-Q", queues,
            "-n", f"{name}@%h", "--without-mingle", "--without-gossip", "--without-heartbeat",
            "--loglevel", "INFO", "-f", str(logfile), *(extra_args or []),
        ]  # fmt: skip
        proc = subprocess.Popen(
            [*(command_prefix or []), *cmd], cwd=ROOT, env=full_env,
            stdout=stdout.open("wb") if stdout is not None else subprocess.DEVNULL,
            stderr=(self.tmp_path / f"{name}.err").open("wb"),
            start_new_session=True,
        )  # fmt: skip
        worker = Worker(name=name, proc=proc, logfile=logfile, env=full_env)
        self.workers.append(worker)
        if wait:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: Worker, timeout: float = 60) -> None:
        def ready() -> bool:
            if not worker.alive():
                err = (self.tmp_path / f"{worker.name}.err").read_text(errors="replace")
                raise AssertionError(f"worker {worker.name} exited early:\n{worker.log()}\n{err}")
            return " ready." in worker.log()

        wait_for(ready, timeout=timeout, interval=0.1, what=f"worker {worker.name} ready")

    def stop_all(self, timeout: float = 15) -> None:
        """Warm shutdown of every worker at once, with one deadline, then SIGKILL of each."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            worker.stop(timeout=max(0.0, deadline - time.monotonic()))


#: A test's workers are killed once it has ended (its assertions are made): a warm shutdown
#: waited for any body left running (a gate never opened, a long sleep), up to 15 s a test,
#: and took 1-2 s for an idle worker, 5-8 s on a loaded host.
TEARDOWN_GRACE_SECONDS = 0.0


@pytest.fixture
def workers(transactional_db: None, tmp_path: Path) -> Iterator[WorkerFactory]:
    """Start real worker subprocesses against the test database; all stopped afterwards."""
    url = broker_url()
    if url.startswith("redis"):
        from urllib.parse import urlparse

        parsed = urlparse(url)
        require_service("Redis", parsed.hostname or "127.0.0.1", parsed.port or 6379)
        redis_flushdb(url)
    factory = WorkerFactory(tmp_path)
    yield factory
    factory.stop_all(timeout=TEARDOWN_GRACE_SECONDS)


class BeatFactory:
    """Real ``celery beat`` processes running ``LockedScheduler`` against the test database."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.beats: list[Worker] = []

    def start(
        self, *, env: dict[str, str] | None = None, broker: str | None = None, command_prefix: list[str] | None = None
    ) -> Worker:
        """Start a beat; ``command_prefix`` wraps its command (e.g. a test host's ``ip netns exec``)."""
        name = f"beat{len(self.beats) + 1}-{uuid.uuid4().hex[:6]}"
        logfile = self.tmp_path / f"{name}.log"
        full_env = celery_env(broker, env)
        cmd = [
            sys.executable, "-m", "celery", "-A", "config", "beat", "-S", "taskplatform.beat.LockedScheduler",
            "--loglevel", "INFO", "-f", str(logfile), "--pidfile=",
        ]  # fmt: skip
        # The beat runs from tmp_path: put the repository on the path after any given one (the
        # guard ablation runs the suite against a mutated copy of the platform that way).
        pythonpath = os.pathsep.join(filter(None, (full_env.get("PYTHONPATH"), str(ROOT))))
        proc = subprocess.Popen(
            [*(command_prefix or []), *cmd], cwd=self.tmp_path, env={**full_env, "PYTHONPATH": pythonpath},
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp_path / f"{name}.err").open("wb"), start_new_session=True,
        )  # fmt: skip
        beat = Worker(name=name, proc=proc, logfile=logfile, env=full_env)
        self.beats.append(beat)
        return beat

    def err(self, beat: Worker) -> str:
        return (self.tmp_path / f"{beat.name}.err").read_text(errors="replace")

    def by_pid(self, pid: int) -> Worker:
        return next(b for b in self.beats if b.pid == pid)

    def stop_all(self) -> None:
        """SIGTERM to every beat at once (a follower is not left to take over from each
        leader stopped before it), then each waited for."""
        for beat in self.beats:
            beat.terminate()
        for beat in self.beats:
            beat.stop()


@pytest.fixture
def beats(transactional_db: None, tmp_path: Path) -> Iterator[BeatFactory]:
    """Start real beat subprocesses against the test database; all stopped afterwards. The
    broker starts empty: the beat tests count the messages waiting on it, and an earlier
    test's leftovers (a flow test publishes duplicates on purpose) must not count."""
    url = broker_url()
    if url.startswith("redis"):
        redis_flushdb(url)
    factory = BeatFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture
def poll() -> Callable[..., Any]:
    """``poll(predicate, timeout=..., what=...)``: wait for an observable effect, bounded."""
    return wait_for


@pytest.fixture
def use_broker() -> Iterator[Callable[[str], None]]:
    """Point this process's Celery app at another broker for one test (publishing side)."""
    from celery import current_app

    original = current_app.conf.broker_url

    def switch(url: str) -> None:
        # Celery's Settings.broker_url prefers the CELERY_BROKER_URL environment variable.
        os.environ["CELERY_BROKER_URL"] = url
        # Drop the app's references to the old broker's pools (kombu keeps them registered per
        # URL, so closing them would break switching back; app.close() deregisters the app).
        current_app._pool = None
        current_app.amqp._producer_pool = None
        current_app.conf.broker_url = url

    yield switch
    switch(original)


@pytest.fixture
def open_gate() -> Callable[[str], None]:
    """Let task bodies waiting on gate ``name`` continue."""

    def _open(name: str) -> None:
        from tests.testapp.models import Gate

        Gate.objects.update_or_create(name=name, defaults={"open": True})

    return _open
