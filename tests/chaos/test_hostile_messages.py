"""Scenario 37: foreign content put straight onto the broker. The worker accepts JSON only: a
pickle that would run code when loaded, a body that is not JSON, and a message without a task
name are refused and logged; none of them runs anything, and the worker keeps serving."""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

from taskplatform import submit
from tests.conftest import broker_url
from tests.helpers import state_of, tally

pytestmark = [pytest.mark.worker, pytest.mark.fault, pytest.mark.timeout(120)]


class _OpensAFile:
    """Unpickling this creates ``path``: the marker of code run from a message."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def _publish_raw(body: bytes, content_type: str, headers: dict[str, Any]) -> None:
    with Connection(broker_url()) as connection:
        producer = connection.Producer()
        producer.publish(
            body,
            routing_key="celery",
            content_type=content_type,
            content_encoding="binary" if content_type != "application/json" else "utf-8",
            headers=headers,
        )


@pytest.mark.scenario(37)
def test_pickle_malformed_json_and_nameless_messages_are_refused_and_the_worker_keeps_serving(
    workers: Any, poll: Any, tmp_path: Path, figures: Any
) -> None:
    worker = workers.start(concurrency=1)
    marker = tmp_path / "pickle-ran"
    hostile = [
        # A pickle whose loading would create the marker file (CVE-2021-23727's shape).
        (
            pickle.dumps(((_OpensAFile(marker),), {}, {})),
            "application/x-python-serialize",
            {"task": "testapp.effect", "id": str(uuid.uuid4()), "lang": "py"},
        ),
        (b'{"a":', "application/json", {"task": "testapp.effect", "id": str(uuid.uuid4()), "lang": "py"}),
        (b"[[], {}, {}]", "application/json", {"id": str(uuid.uuid4()), "lang": "py"}),  # no task name
    ]
    for body, content_type, headers in hostile:
        _publish_raw(body, content_type, headers)
    after = submit("testapp.effect")  # queued behind them: it runs only if the worker got past them
    poll(lambda: state_of(after.pk) == "SUCCEEDED", timeout=60, what="the worker to serve the next execution")
    log = worker.log()
    figures.record(
        hostile_messages=len(hostile),
        code_run=int(marker.exists()),
        **tally([after]),
        worker_alive=int(worker.alive()),
    )
    assert not marker.exists(), "a pickle from the broker was loaded"
    assert worker.alive()
    assert "ContentDisallowed" in log or "Refusing to deserialize untrusted content of type pickle" in log, log[-3000:]
