"""Admin for the reference deployment's data."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from .models import ApiToken, Campaign, ClientRequest, Coupon


@admin.register(Campaign)
class CampaignAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "stock", "created_at")
    search_fields = ("slug", "name")


@admin.register(Coupon)
class CouponAdmin(admin.ModelAdmin):
    list_display = ("code", "campaign", "user", "issued_at")
    list_filter = ("campaign",)
    search_fields = ("code", "user__username")
    raw_id_fields = ("user",)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Adding a token generates its key, stores only the hash and shows the key once.

    As ``manage.py issue_api_token`` does. The key is rendered in the response to the add
    form itself (no redirect), so it never passes through the session or a messages cookie,
    and the page is marked ``no-store``. A lost key cannot be shown again: add a new token
    and delete the old one.
    """

    list_display = ("name", "user", "created_at", "last_used_at")
    readonly_fields = ("key_hash", "created_at", "last_used_at")
    raw_id_fields = ("user",)

    def get_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> list[Any]:
        """The add form asks only what the token is for and whose it is; the key is generated."""
        if obj is None:
            return ["user", "name"]
        return list(super().get_fields(request, obj))

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if not change:
            raw, obj.key_hash = ApiToken.new_key()
            request._issued_api_key = raw  # type: ignore[attr-defined]  # read by response_add
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiToken, post_url_continue: str | None = None) -> HttpResponse:
        raw = getattr(request, "_issued_api_key", None)
        if raw is None:  # pragma: no cover - save_model always sets it on add
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "title": "API token created",
            "opts": self.model._meta,
            "token": obj,
            "raw_key": raw,
        }
        response = TemplateResponse(request, "admin/tasks/apitoken/key_issued.html", context)
        response["Cache-Control"] = "no-store"
        return response


@admin.register(ClientRequest)
class ClientRequestAdmin(admin.ModelAdmin):
    list_display = ("user", "key", "execution", "created_at")
    search_fields = ("key", "user__username")
    raw_id_fields = ("user", "execution")
