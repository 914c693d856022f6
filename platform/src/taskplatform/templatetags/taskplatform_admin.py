"""``{% taskplatform_overview %}``: the console's landing section (``overview.py``)."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.inclusion_tag("admin/taskplatform/overview.html")
def taskplatform_overview() -> dict[str, Any]:
    from ..overview import context

    return context()
