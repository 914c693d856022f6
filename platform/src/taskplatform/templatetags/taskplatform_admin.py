"""``{% taskplatform_overview %}``: the console's landing section (``console.overview``)."""

from __future__ import annotations

from typing import Any

from django import template

from ..console.overview import context

register = template.Library()


@register.inclusion_tag("admin/taskplatform/overview.html")
def taskplatform_overview() -> dict[str, Any]:
    return context()
