"""URL configuration of the reference deployment."""

from django.contrib import admin
from django.urls import include, path

from taskplatform.observability.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("tasks.urls")),
    path("metrics", metrics_view, name="metrics"),
]
