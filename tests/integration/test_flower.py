"""Flower, started the way deployments start it (``bin/flower``), sits behind authentication
and sees the platform's tasks through task events."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskplatform import submit
from taskplatform.models import Execution
from tests.conftest import ROOT, celery_env, free_port, port_open
from tests.helpers import state_of, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

USER, PASSWORD = "operator", "s3cret-for-this-test"


def get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start_flower(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(ROOT / "bin" / "flower")],
        cwd=ROOT,
        env=celery_env(env={"PYTHON": sys.executable, **env}),
        stdout=(tmp_path / "flower.out").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture
def flower(workers: Any, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = start_flower(tmp_path, {"FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}", "FLOWER_PORT": str(port)})
    try:
        wait_for(lambda: port_open("127.0.0.1", port, 0.2), timeout=60, what="Flower to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_flower_shows_a_completed_task_to_an_authenticated_operator(workers: Any, flower: str) -> None:
    workers.start(concurrency=1)
    # Flower learns about workers and tasks from events; wait until it sees the worker.
    wait_for(
        lambda: (
            get(f"{flower}/api/workers?refresh=1", (USER, PASSWORD))[0] == 200
            and json.loads(get(f"{flower}/api/workers?refresh=1", (USER, PASSWORD))[1])
        ),
        timeout=60,
        interval=0.5,
        what="Flower to see the worker",
    )
    execution = submit("testapp.effect", kwargs={})
    wait_for(lambda: state_of(execution.pk) == "SUCCEEDED", timeout=60, what="the task to succeed")
    task_id = Execution.objects.get(pk=execution.pk).celery_task_id

    def flower_says_succeeded() -> dict[str, Any] | None:
        status, body = get(f"{flower}/api/task/info/{task_id}", (USER, PASSWORD))
        info = json.loads(body) if status == 200 else None
        return info if info and info.get("state") == "SUCCESS" else None

    info = wait_for(flower_says_succeeded, timeout=30, interval=0.25, what="Flower to report the task")
    assert info["name"] == "testapp.effect"
    assert info["uuid"] == task_id


def post(url: str, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url, data=b"{}", method="POST")
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.scenario(38)
def test_flower_refuses_requests_without_or_with_wrong_credentials(flower: str, figures: Any) -> None:
    refused = [
        get(f"{flower}/api/workers")[0],
        get(f"{flower}/api/workers", (USER, "wrong"))[0],
        get(f"{flower}/")[0],
        get(f"{flower}/metrics")[0],  # open in stock Flower (flower#1342); closed by config.flower
        post(f"{flower}/api/task/async-apply/testapp.effect"),  # the API that runs tasks
        post(f"{flower}/api/task/async-apply/testapp.effect", (USER, "wrong")),
    ]
    figures.record(anonymous_or_wrong_requests=len(refused), answered_401=refused.count(401))
    assert refused == [401] * len(refused)
    status, body = get(f"{flower}/metrics", (USER, PASSWORD))
    assert status == 200 and b"flower_" in body
    assert get(f"{flower}/api/workers", (USER, PASSWORD))[0] == 200


@pytest.mark.scenario(38)
def test_flower_will_not_start_without_authentication(tmp_path: Path, figures: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    unsafe = [
        ({}, b"FLOWER_BASIC_AUTH"),
        ({"FLOWER_BASIC_AUTH": "operator:"}, b"FLOWER_BASIC_AUTH"),
        ({"FLOWER_AUTH": ".*@example.com"}, b"must end with $"),  # CVE-2022-30034: unanchored
        ({"FLOWER_BASIC_AUTH": "operator:pw", "FLOWER_UNAUTHENTICATED_API": "true"}, b"FLOWER_UNAUTHENTICATED_API"),
    ]
    refusals = 0
    for extra, message in unsafe:
        proc = subprocess.run(
            [str(ROOT / "bin" / "flower")],
            cwd=ROOT,
            env={**env, "FLOWER_PORT": str(free_port()), **extra},
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode == 2, extra
        assert message in proc.stderr, (extra, proc.stderr)
        refusals += 1
    figures.record(unsafe_configurations=len(unsafe), refused_to_start=refusals)
