"""The public functions other code calls: submit work, give a job a schedule.

``taskplatform.submit``, ``submit_many`` and friends resolve here (lazily, from the package
root), so a project's code imports one stable place while the implementation lives in its
layer: submission in ``core.submission``, job schedules in the ``jobs`` service.
"""

from __future__ import annotations

from .core.flows import submit_flow, submit_flow_or_get
from .core.submission import SubmitManyResult, submit, submit_many, submit_or_get
from .domain.flows import Flow, Step
from .jobs import define_limit, schedule_job

__all__ = [
    "Flow",
    "Step",
    "SubmitManyResult",
    "define_limit",
    "schedule_job",
    "submit",
    "submit_flow",
    "submit_flow_or_get",
    "submit_many",
    "submit_or_get",
]
