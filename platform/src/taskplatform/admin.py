"""Admin registrations: job definitions and a read-only view of the ledger.

The ledger is read-only here by design: state changes go through ``taskplatform.ledger``
(operator actions with reasons and permissions are added by the operator console).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import Execution, ExecutionEvent, JobDefinition


@admin.register(JobDefinition)
class JobDefinitionAdmin(admin.ModelAdmin):
    list_display = ("slug", "task", "periodic_task", "misfire_policy", "queue", "max_attempts", "enabled", "updated_at")
    list_select_related = ("periodic_task",)
    list_filter = ("enabled", "queue")
    search_fields = ("slug", "task", "description")


class ExecutionEventInline(admin.TabularInline):
    model = ExecutionEvent
    extra = 0
    can_delete = False
    fields = ("at", "kind", "from_state", "to_state", "attempt", "fencing_token", "actor", "reason", "data")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Execution)
class ExecutionAdmin(admin.ModelAdmin):
    list_display = ("id", "task_name", "idempotency_key", "state", "attempts", "trigger", "created_at", "finished_at")
    list_filter = ("state", "trigger", "task_name")
    search_fields = ("idempotency_key", "celery_task_id", "task_name")
    date_hierarchy = "created_at"
    inlines = [ExecutionEventInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Execution._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
