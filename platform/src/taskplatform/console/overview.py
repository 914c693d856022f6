"""The console's landing section: counts per state, dead letters, stuck work, a 24-hour chart.

The chart is an inline SVG (no JavaScript, no external resource): executions finished per
hour, succeeded and failed, and retries scheduled per hour, for the last 24 hours. This module
computes its geometry; ``templates/admin/taskplatform/chart.svg.html`` draws it and the
console's stylesheet colours it for the admin's light and dark themes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count
from django.db.models.functions import TruncHour
from django.utils import timezone

from ..conf import platform_settings
from ..domain.states import State
from ..models import CountsSnapshot, Execution, ExecutionEvent
from ..observability.metrics import first_event_id_since

#: The chart's series, in drawing order (each coloured by the ``tp-series-<name>`` CSS class).
SERIES = ("succeeded", "failed", "retried")


@dataclass
class Overview:
    counts: dict[str, int]
    dead_letters: int
    stuck: int
    hours: list[datetime]
    series: dict[str, list[int]] = field(default_factory=dict)
    #: When the counts per state were taken (the maintenance snapshot), None: counted live.
    counted_at: datetime | None = None
    #: The oldest a snapshot may be and still be shown (older: counted live), in seconds.
    counts_max_age: int = 0

    @property
    def chart(self) -> dict[str, Any]:
        return chart_geometry(self.hours, self.series)


def _hour(value: datetime) -> datetime:
    return value.astimezone(timezone.get_current_timezone()).replace(minute=0, second=0, microsecond=0)


def overview(now: datetime | None = None) -> Overview:
    now = now or timezone.now()
    counts = {state.value: 0 for state in State}
    max_age = 3 * platform_settings().counts_interval_seconds
    rows, counted_at, _age = CountsSnapshot.executions(max_age_seconds=max_age)
    for state, _job, n in rows:
        counts[state] = counts.get(state, 0) + n
    # What an operator acts on is counted now (a state-led index each): the dead letters, as the
    # list their link opens shows them, and stuck work.
    dead_letters = Execution.objects.filter(state=State.FAILED).count()
    stuck = Execution.objects.stuck(now).count()
    first = _hour(now) - timedelta(hours=23)
    hours = [first + timedelta(hours=i) for i in range(24)]
    index = {h: i for i, h in enumerate(hours)}
    series = {name: [0] * 24 for name in SERIES}
    finished = (
        Execution.objects.filter(finished_at__gte=first, state__in=(State.SUCCEEDED, State.FAILED))
        .annotate(hour=TruncHour("finished_at"))
        .values("hour", "state")
        .annotate(n=Count("id"))
        .order_by()
    )
    for done in finished:
        i = index.get(_hour(done["hour"]))
        if i is not None:
            series["succeeded" if done["state"] == State.SUCCEEDED else "failed"][i] += done["n"]
    start = first_event_id_since(first)
    if start is not None:
        retries = (
            ExecutionEvent.objects.filter(id__gte=start, kind="retry_scheduled")
            .annotate(hour=TruncHour("at"))
            .values("hour")
            .annotate(n=Count("id"))
            .order_by()
        )
        for retry in retries:
            i = index.get(_hour(retry["hour"]))
            if i is not None:
                series["retried"][i] += retry["n"]
    return Overview(
        counts=counts,
        dead_letters=dead_letters,
        stuck=stuck,
        hours=hours,
        series=series,
        counted_at=counted_at,
        counts_max_age=max_age,
    )


def chart_geometry(hours: list[datetime], series: dict[str, list[int]]) -> dict[str, Any]:
    """Grouped bars per hour, a y axis with its maximum, hour labels every 3 hours, a legend."""
    width, height, left, bottom, top = 760, 200, 40, 24, 16
    plot_w, plot_h = width - left - 10, height - bottom - top
    peak = max([1, *(v for values in series.values() for v in values)])
    group = plot_w / max(1, len(hours))
    bar = max(1.0, (group - 4) / len(SERIES))
    bars, ticks = [], []
    for i, hour in enumerate(hours):
        x0 = left + i * group + 2
        for j, name in enumerate(SERIES):
            value = series[name][i]
            h = plot_h * value / peak
            bars.append(
                {
                    "series": name,
                    "x": f"{x0 + j * bar:.1f}",
                    "y": f"{top + plot_h - h:.1f}",
                    "width": f"{bar:.1f}",
                    "height": f"{h:.1f}",
                    "hour": hour.strftime("%H:00"),
                    "value": value,
                }
            )
        if i % 3 == 0:
            ticks.append({"x": f"{x0:.1f}", "label": hour.strftime("%H:00")})
    return {
        "width": width,
        "height": height,
        "left": left,
        "right": width - 10,
        "baseline": top + plot_h,
        "label_x": left - 6,
        "peak": peak,
        "peak_y": top + 4,
        "tick_y": height - 8,
        "bars": bars,
        "ticks": ticks,
        "legend": [
            {"series": name, "x": left + j * 110, "text_x": left + j * 110 + 14} for j, name in enumerate(SERIES)
        ],
    }


def context() -> dict[str, Any]:
    return {"overview": overview(), "states": [s.value for s in State]}
