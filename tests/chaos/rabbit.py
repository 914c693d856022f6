"""A private RabbitMQ node for the broker fault tests: its own node name, ports, data, logs,
configuration and Erlang cookie, so a test may stop, restart or kill it without touching the
machine's RabbitMQ (which listens on 5672).

The node is started from the real ``rabbitmq-server`` script (not Debian's wrapper in
``/usr/sbin``, which would switch to the ``rabbitmq`` user and the machine's cookie), with
``HOME`` pointing into the node's own folder: the Erlang VM writes its cookie there and
``rabbitmqctl`` reads the same one. Only the node's own ``beam.smp`` (read from the PID file
it writes, and checked to be a child of the script we started) is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.conftest import free_port, port_open
from tests.helpers import wait_for

#: Where Debian keeps the real scripts; ``/usr/sbin/rabbitmq-*`` are wrappers that ``su``.
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")


def rabbitmq_script(name: str) -> str | None:
    """The path of ``rabbitmq-server`` / ``rabbitmqctl``, or None if RabbitMQ is not installed."""
    candidate = RABBITMQ_BIN / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def missing() -> str:
    """Why a private node cannot be started here ('' if it can)."""
    for name in ("rabbitmq-server", "rabbitmqctl"):
        if rabbitmq_script(name) is None:
            return f"{name} is not installed"
    return ""


@dataclass
class RabbitNode:
    """One RabbitMQ node this test module owns, on free ports, under ``base``."""

    base: Path
    name: str = field(default_factory=lambda: f"tp{uuid.uuid4().hex[:8]}@localhost")
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def pid_file(self) -> Path:
        return self.base / "rabbit.pid"

    @property
    def env(self) -> dict[str, str]:
        home = self.base / "home"
        return {
            **os.environ,
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            # Not /etc/rabbitmq/rabbitmq-env.conf (it names the machine's node).
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def prepare(self) -> None:
        (self.base / "home").mkdir(parents=True, exist_ok=True)
        (self.base / "log").mkdir(exist_ok=True)
        (self.base / "mnesia").mkdir(exist_ok=True)
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "rabbitmq-env.conf").write_text("")
        # The machine's /etc/rabbitmq/rabbitmq.conf pins 5672: this file replaces it.
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\ndisk_free_limit.absolute = 10MB\n"
        )

    def start(self, timeout: float = 120) -> None:
        """Start (or restart, on the same data) the node and wait until it takes connections."""
        script = rabbitmq_script("rabbitmq-server")
        assert script is not None
        self.prepare()
        self.pid_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [script],
            cwd=self.base,
            env=self.env,
            stdout=(self.base / "server.out").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                out = (self.base / "server.out").read_text(errors="replace")
                raise AssertionError(f"rabbitmq-server {self.name} exited:\n{out[-3000:]}")
            return port_open("127.0.0.1", self.port, 0.2)

        wait_for(ready, timeout=timeout, interval=0.2, what=f"RabbitMQ node {self.name} on :{self.port}")

    def ctl(self, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl -n <this node> ...`` (same cookie: same HOME)."""
        script = rabbitmq_script("rabbitmqctl")
        assert script is not None
        done = subprocess.run(
            [script, "-n", self.name, *args],
            env=self.env,
            cwd=self.base,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise AssertionError(f"rabbitmqctl {' '.join(args)} failed ({done.returncode}):\n{out}")
        return out

    def stop_app(self) -> None:
        self.ctl("stop_app")

    def start_app(self) -> None:
        self.ctl("start_app")
        self.wait_ready()

    def beam_pid(self) -> int:
        """The PID of this node's Erlang VM: from its PID file, and a child of our script."""
        pid = int(self.pid_file.read_text().strip())
        process = psutil.Process(pid)
        assert process.name().startswith("beam"), f"pid {pid} is {process.name()}, not this node's beam.smp"
        assert self.proc is not None and process.ppid() == self.proc.pid, "the VM is not a child of our script"
        return pid

    def kill(self) -> None:
        """SIGKILL the node's Erlang VM (a crash: no clean shutdown, nothing flushed on purpose)."""
        os.kill(self.beam_pid(), signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(timeout=30)
        wait_for(lambda: not port_open("127.0.0.1", self.port, 0.2), timeout=30, what="the node's port closed")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the node: ``rabbitmqctl stop``, then SIGKILL of its own VM if still there."""
        if not self.running():
            return
        with contextlib.suppress(Exception):
            self.ctl("stop", timeout=60)
        assert self.proc is not None
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(Exception):
                os.kill(self.beam_pid(), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
