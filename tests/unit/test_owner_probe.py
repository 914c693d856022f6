"""The dead-owner probe used to take over a killed pool child's attempt without waiting."""

from __future__ import annotations

import os
import subprocess

from taskplatform.worker.owner import owner_alive_on, process_alive
from tests.helpers import wait_for


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_zombie_counts_as_dead_like_a_reaped_process():
    child = subprocess.Popen(["true"])
    # Exited but not reaped: what a killed pool child is until billiard notices.
    wait_for(lambda: _state(child.pid) == "Z", timeout=5, what="zombie")
    assert process_alive(child.pid) is False
    child.wait()
    assert process_alive(child.pid) is False
    assert process_alive(os.getpid()) is True


def test_only_owners_on_this_node_can_be_judged():
    probe = owner_alive_on("w1@host")
    child = subprocess.Popen(["true"])
    child.wait()
    assert probe(f"w1@host:{child.pid}") is False
    assert probe(f"w2@host:{child.pid}") is None  # another node: the lease decides
    assert probe(f"w1@host:{os.getpid()}") is None  # ourselves (thread pools): the lease decides
    assert probe("garbage") is None
