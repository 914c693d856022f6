"""Admin for the reference deployment's data."""

from __future__ import annotations

from django.contrib import admin

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
    list_display = ("name", "user", "created_at", "last_used_at")
    readonly_fields = ("key_hash", "created_at", "last_used_at")
    raw_id_fields = ("user",)


@admin.register(ClientRequest)
class ClientRequestAdmin(admin.ModelAdmin):
    list_display = ("user", "key", "execution", "created_at")
    search_fields = ("key", "user__username")
    raw_id_fields = ("user", "execution")
