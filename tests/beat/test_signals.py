"""A leading ``celery beat`` stops on Ctrl-C under ``make run``: SIGINT and SIGTERM together.

Found by the review of issue 14: celery beat calls ``LockedScheduler.close()`` from its
handler of each signal; the second ran ``close()`` again inside the first one's database call,
and the beat hung on its own connection (1 run in 6). It must exit promptly every time, having
released its lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.helpers import wait_for

pytestmark = [pytest.mark.worker]


def stacks(pid: int) -> str:
    """The hung process's threads (py-spy, from the bench requirements), for the failure message."""
    import shutil
    import sys
    from pathlib import Path

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(no stacks: py-spy is not installed; make .venv/.installed-bench installs it)"
    result = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False)
    return result.stdout + result.stderr


def test_a_leading_beat_given_sigint_and_sigterm_together_exits_and_releases_its_lease(beats):
    for round_ in range(3):
        beat = beats.start()
        wait_for(lambda b=beat: " leads (lease" in b.log(), timeout=60, what=f"round {round_}: the beat leads")
        os.kill(beat.pid, signal.SIGINT)
        time.sleep(0.02)  # the fault itself: a second signal 20 ms after the first (not synchronisation)
        os.kill(beat.pid, signal.SIGTERM)
        try:
            beat.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"round {round_}: the beat hung after SIGINT + SIGTERM:\n{beat.log()[-3000:]}\n{stacks(beat.pid)}"
            )
        log = beat.log()
        assert "released the lease" in log, f"round {round_}:\n{log[-3000:]}\n{beats.err(beat)[-3000:]}"
