"""The soak's CI version (issue 13): ``bench/soak.py`` with 20,000 executions and every check.

The soak runs as a subprocess with processes, a database and a Redis server of its own: its
database is named after this process (``taskplatform_soak_ci_<pid>``, dropped at the end), its
``redis-server`` listens on a free port, and its faults (``pg_terminate_backend`` included) touch
only those. So it runs beside the rest of the suite under pytest-xdist, and beside a manual
``make soak`` (database ``taskplatform_soak``, port 6390).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI, ROOT, require_service

pytestmark = [pytest.mark.worker, pytest.mark.fault]

EXECUTIONS = 20_000
#: Environment the soak sets itself: a value left by the suite's own settings must not leak in.
OWN_PREFIXES = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "CELERY_", "TASKPLATFORM_")


@pytest.mark.timeout(1200)
def test_soak_of_20000_executions_loses_nothing_and_explains_every_rerun(tmp_path: Path) -> None:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("redis-server binary not on PATH (CI=true: a missing service is a failure, not a skip)")
        pytest.skip("redis-server binary not on PATH")
    result_path = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES)}
    cmd = [
        sys.executable, str(ROOT / "bench" / "soak.py"), "--executions", str(EXECUTIONS),
        "--database", f"taskplatform_soak_ci_{os.getpid()}", "--drop-after", "--redis-port", "0",
        "--workdir", str(tmp_path / "work"), "--json", str(result_path), "--markdown", str(tmp_path / "soak.md"),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1150)
    output = run.stdout[-6000:] + run.stderr[-4000:]
    assert result_path.exists(), f"the soak wrote no result (exit {run.returncode}):\n{output}"
    result = json.loads(result_path.read_text())
    checks = result["checks"]

    assert result["executions"] >= EXECUTIONS, output
    assert result["submitted"].get("submit", 0) > 0 and result["submitted"].get("submit_many", 0) > 0
    assert result["slots"] > 0, "no beat slot ran"
    assert result["planned_failures"] > 0 and result["retries_parked_in_ledger"] > 0
    injected = result["fault_counts"]
    kinds = ("worker_kill", "child_kill", "beat_kill", "beat_stop", "redis_restart", "pg_terminate")
    assert all(injected.get(kind, 0) >= 1 for kind in kinds), f"faults injected: {injected}"
    assert not checks["faults_not_injected"], f"planned faults that did not happen: {checks['faults_not_injected']}"
    assert not checks["failovers_slow"], f"beat failovers over the limit: {checks['failovers_slow']}"

    assert checks["drained"], f"executions still unfinished at the drain's deadline: {result['states']}"
    assert checks["lost_no_row"] == 0, "a recorded key has no ledger row"
    assert checks["not_succeeded"] == 0, f"executions not SUCCEEDED: {result['states']}"
    assert checks["succeeded_without_effect"] == 0, "an execution SUCCEEDED without its effect"
    assert checks["rows_not_accounted"] == 0 and checks["effects_without_row"] == 0
    assert checks["slots_missing"] == 0 and checks["slots_off_grid"] == 0, "a beat slot was lost or off its grid"
    assert checks["atomic_duplicate_effects"] == 0, "an atomic body's effect was committed twice"
    reruns = result["plain_reruns"]
    assert checks["plain_reruns_unexplained"] == 0, f"re-runs no fault explains: {reruns['unexplained']}"
    assert not checks["unexpected_exits"], checks["unexpected_exits"]
    assert not checks["rss_not_flat"], f"RSS grew: {checks['rss_not_flat']}"
    assert result["passed"] and run.returncode == 0, output
