"""Prometheus metrics for the platform, read from the ledger at scrape time.

The ledger is the system of record for every worker and beat on every host, so one scrape
of one web process sees the whole fleet: no per-process registries to aggregate, no
multiprocess directory, the same answer from any gunicorn worker. Every metric is a gauge.
Event metrics count the events of the last ``TASKPLATFORM_METRICS_WINDOW_SECONDS`` (take
``/ window`` for a rate); state metrics count rows now.

Mount ``metrics_view`` (``config/urls.py`` does, at ``/metrics``). It answers a staff session
with the ``taskplatform.view_execution`` permission (what the console's execution list needs),
or ``Authorization: Bearer <TASKPLATFORM_METRICS_TOKEN>`` (what Prometheus sends with
``authorization: {credentials: ...}`` in its scrape config); anything else gets ``401``.
Flower's own ``/metrics`` (Celery task events) stays available beside it.

The metric names and their meaning are tabled in ``docs/metrics.md``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, ExpressionWrapper, F, fields
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from ..conf import platform_settings
from ..domain.states import State
from ..exceptions import MissingDependencyError
from ..models import BeatProcess, CountsSnapshot, EventKind, Execution, ExecutionEvent, SchedulerFence


def first_event_id_since(moment: datetime) -> int | None:
    """The id of the first event at or after ``moment``, by bisecting the primary key.

    Events are appended with the time of insertion, so ``at`` grows with ``id`` (to within
    the clock skew of concurrent writers); about 30 primary-key lookups find the window
    without an index on ``at`` (which would cost every claim and completion an index write).
    """
    bounds = ExecutionEvent.objects.order_by("id").values_list("id", flat=True)
    first, last = bounds.first(), bounds.last()
    if first is None or last is None:
        return None

    def at_or_after(i: int) -> tuple[int, datetime] | None:
        row = ExecutionEvent.objects.filter(id__gte=i).order_by("id").values_list("id", "at").first()
        return (row[0], row[1]) if row else None

    if (last_row := at_or_after(last)) is None or last_row[1] < moment:
        return None
    lo, hi = first, last
    while lo < hi:
        mid = (lo + hi) // 2
        row = at_or_after(mid)
        if row is None or row[1] >= moment:
            hi = mid
        else:
            lo = row[0] + 1
    return lo


class LedgerCollector:
    """A prometheus_client collector computing the table above at each scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        now = timezone.now()
        window = platform_settings().metrics_window_seconds
        since = now - timedelta(seconds=window)

        executions = GaugeMetricFamily(
            "taskplatform_executions", "Executions in the ledger, by state and job.", labels=["state", "job"]
        )
        interval = platform_settings().counts_interval_seconds
        rows, _counted_at, age = CountsSnapshot.executions(max_age_seconds=3 * interval)
        for state, job, n in rows:
            executions.add_metric([state, job], n)
        yield executions
        yield GaugeMetricFamily(
            "taskplatform_counts_age_seconds",
            "Age of the executions counts above (the maintenance snapshot; 0: counted at this scrape).",
            value=age,
        )
        # Counted at the scrape, as alerts need them: dead letters and running attempts (each a
        # state-led index), so the leases below never mix a snapshot with a live count.
        counts = {
            row["state"]: row["n"]
            for row in Execution.objects.filter(state__in=(State.FAILED, State.RUNNING))
            .values("state")
            .annotate(n=Count("id"))
            .order_by()
        }
        yield GaugeMetricFamily(
            "taskplatform_dead_letters", "Executions in FAILED.", value=counts.get(State.FAILED.value, 0)
        )
        expired = Execution.objects.lease_expired(now).count()
        yield GaugeMetricFamily("taskplatform_expired_leases", "RUNNING executions whose lease ran out.", value=expired)
        leases = GaugeMetricFamily(
            "taskplatform_leases",
            "Leases of RUNNING executions: live (renewed in time by their worker's heartbeat) or expired.",
            labels=["status"],
        )
        leases.add_metric(["live"], counts.get(State.RUNNING.value, 0) - expired)
        leases.add_metric(["expired"], expired)
        yield leases
        yield GaugeMetricFamily(
            "taskplatform_overdue_unclaimed",
            "PENDING/RETRYING/WAITING executions past due_at.",
            value=Execution.objects.overdue(now).count(),
        )

        events = GaugeMetricFamily(
            "taskplatform_events_window", "Ledger events in the metrics window, by kind.", labels=["kind"]
        )
        start = first_event_id_since(since)
        seen: dict[str, int] = {}
        if start is not None:
            kinds = ExecutionEvent.objects.filter(id__gte=start).values("kind").annotate(n=Count("id")).order_by()
            seen = {row["kind"]: row["n"] for row in kinds}
        for kind in EventKind:
            events.add_metric([kind.value], seen.get(kind.value, 0))
        yield events
        yield GaugeMetricFamily("taskplatform_metrics_window_seconds", "The metrics window.", value=window)

        yield from self._beat(now, since)

    def _beat(self, now: datetime, since: datetime) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        conf = platform_settings()
        fence = SchedulerFence.objects.filter(name=conf.beat_lock_name).first()
        leader = GaugeMetricFamily("taskplatform_beat_leader", "1 for the beat leader.", labels=["identity"])
        if fence is not None and fence.leader:
            leader.add_metric([fence.leader], 1)
        yield leader
        yield GaugeMetricFamily(
            "taskplatform_beat_fencing_token",
            "The beat leader's fencing token.",
            value=fence.fencing_token if fence else 0,
        )
        roles = GaugeMetricFamily("taskplatform_beat_processes", "Beats seen within 30 s, by role.", labels=["role"])
        recent = BeatProcess.objects.filter(
            lock_name=conf.beat_lock_name, stopped_at=None, last_seen_at__gte=now - timedelta(seconds=30)
        )
        leaders = recent.filter(is_leader=True).count()
        roles.add_metric(["leader"], leaders)
        roles.add_metric(["follower"], recent.count() - leaders)
        yield roles

        lateness = GaugeMetricFamily(
            "taskplatform_beat_publication_lateness_seconds",
            "Lateness of slots published in the window (created_at - scheduled_for).",
            labels=["quantile"],
        )
        published = Execution.objects.filter(
            trigger="beat", created_at__gte=since, scheduled_for__isnull=False
        ).annotate(late=ExpressionWrapper(F("created_at") - F("scheduled_for"), output_field=fields.DurationField()))
        total = published.count()
        if total:
            ordered = published.order_by("late").values_list("late", flat=True)
            for q in (0.5, 0.99, 1.0):
                value = ordered[min(total - 1, int(q * total))]
                lateness.add_metric([str(q)], value.total_seconds() if value is not None else 0.0)
        yield lateness
        yield GaugeMetricFamily(
            "taskplatform_beat_publications_window", "Slots published in the metrics window.", value=total
        )


def render() -> tuple[bytes, str]:
    """The metrics in Prometheus's text format, and its content type."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError:  # pragma: no cover - the extra is installed by the reference deployment
        raise MissingDependencyError("metrics need prometheus_client: pip install 'taskplatform[metrics]'") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector())
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _authorized(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    # The same permission the console's execution list needs: the metrics are counts of
    # executions by task and state, and a staff flag without permissions opens nothing else.
    if user is not None and user.is_authenticated and user.is_staff and user.has_perm("taskplatform.view_execution"):
        return True
    token = platform_settings().metrics_token
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return (
        bool(token)
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode())
    )


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics``: the table above, for a staff session or the metrics bearer token."""
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET"})
    if not _authorized(request):
        return HttpResponse(
            "metrics need a staff session with taskplatform.view_execution"
            " or Authorization: Bearer <TASKPLATFORM_METRICS_TOKEN>\n",
            status=401,
            content_type="text/plain",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )
    body, content_type = render()
    return HttpResponse(body, content_type=content_type)
