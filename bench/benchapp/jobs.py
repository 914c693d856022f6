"""The benchmark's Procrastinate jobs: each body of ``bodies.py`` as one job, on queue ``bench``.

Imported by the Procrastinate worker through ``PROCRASTINATE_IMPORT_PATHS`` (bench/settings.py)
and by ``bench/run.py``, which defers them. Kept apart from ``tasks.py`` so that neither kind
of worker imports the other queue's code.
"""

from __future__ import annotations

from typing import Any

from procrastinate.contrib.django import app

from bench.benchapp.bodies import BODIES

#: The queue the worker listens to; ``bench/run.py`` defers into ``HOLD_QUEUE`` to fill a
#: queue the worker does not read, then moves the jobs here (the drain measurement).
QUEUE = "bench"
HOLD_QUEUE = "bench_hold"


def _register(body_name: str) -> Any:
    body = BODIES[body_name]

    def run(i: int) -> int:
        return body(i)

    return app.task(name=f"bench.procrastinate_{body_name}", queue=QUEUE)(run)


#: JOBS[body]: the Procrastinate task running ``body``.
JOBS: dict[str, Any] = {name: _register(name) for name in BODIES}
