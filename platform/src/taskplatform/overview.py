"""The console's landing section: counts per state, dead letters, stuck work, a 24-hour chart.

The chart is an inline SVG drawn here (no JavaScript, no external resource): executions
finished per hour, succeeded and failed, and retries scheduled per hour, for the last 24 hours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Q
from django.db.models.functions import TruncHour
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from .metrics import first_event_id_since
from .models import Execution, ExecutionEvent
from .states import State

SERIES = (("succeeded", "#198754"), ("failed", "#dc3545"), ("retried", "#fd7e14"))


@dataclass
class Overview:
    counts: dict[str, int]
    dead_letters: int
    stuck: int
    hours: list[datetime]
    series: dict[str, list[int]] = field(default_factory=dict)

    @property
    def chart(self) -> SafeString:
        return render_chart(self.hours, self.series)


def _hour(value: datetime) -> datetime:
    return value.astimezone(timezone.get_current_timezone()).replace(minute=0, second=0, microsecond=0)


def overview(now: datetime | None = None) -> Overview:
    now = now or timezone.now()
    counts = {state.value: 0 for state in State}
    for row in Execution.objects.values("state").annotate(n=Count("id")).order_by():
        counts[row["state"]] = row["n"]
    stuck = Execution.objects.filter(
        Q(state=State.RUNNING, lease_expires_at__lt=now) | Q(state__in=(State.PENDING, State.RETRYING), due_at__lt=now)
    ).count()
    first = _hour(now) - timedelta(hours=23)
    hours = [first + timedelta(hours=i) for i in range(24)]
    index = {h: i for i, h in enumerate(hours)}
    series = {name: [0] * 24 for name, _ in SERIES}
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
    return Overview(counts=counts, dead_letters=counts[State.FAILED.value], stuck=stuck, hours=hours, series=series)


def render_chart(hours: list[datetime], series: dict[str, list[int]]) -> SafeString:
    """Grouped bars per hour, a y axis with its maximum, hour labels every 3 hours, a legend."""
    width, height, left, bottom, top = 760, 200, 40, 24, 16
    plot_w, plot_h = width - left - 10, height - bottom - top
    peak = max([1, *(v for values in series.values() for v in values)])
    group = plot_w / max(1, len(hours))
    bar = max(1.0, (group - 4) / len(SERIES))
    parts: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="tp-chart" role="img" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" aria-label="executions per hour, last 24 hours">',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 10}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="{left - 6}" y="{top + 4}" font-size="10" text-anchor="end">{peak}</text>',
        f'<text x="{left - 6}" y="{top + plot_h}" font-size="10" text-anchor="end">0</text>',
    ]
    for i, hour in enumerate(hours):
        x0 = left + i * group + 2
        for j, (name, colour) in enumerate(SERIES):
            value = series[name][i]
            h = plot_h * value / peak
            parts.append(
                f'<rect x="{x0 + j * bar:.1f}" y="{top + plot_h - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{escape(hour.strftime("%H:00"))} {name}: {value}</title></rect>'
            )
        if i % 3 == 0:
            parts.append(f'<text x="{x0:.1f}" y="{height - 8}" font-size="10">{escape(hour.strftime("%H:00"))}</text>')
    for j, (name, colour) in enumerate(SERIES):
        x = left + j * 110
        parts.append(f'<rect x="{x}" y="0" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 14}" y="9" font-size="11">{name}</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))


def context() -> dict[str, Any]:
    return {"overview": overview(), "states": [s.value for s in State]}
