"""The reference deployment's API (see ``tasks/views.py`` for the contract)."""

from django.urls import path

from . import views

urlpatterns = [
    path("coupons/", views.request_coupon, name="api-coupons"),
    path("reconciliations/", views.request_reconciliation, name="api-reconciliations"),
    path("inventory/sync", views.request_inventory_sync, name="api-inventory-sync"),
    path("executions/<int:pk>", views.execution_detail, name="api-execution"),
    path("orders/", views.request_order, name="api-orders"),
    path("orders/<str:order>", views.order_detail, name="api-order"),
]
