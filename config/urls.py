"""URL configuration of the reference deployment."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from taskplatform.observability.metrics import metrics_view

urlpatterns = [
    # The site's root is the operator console: the admin's "View site" link leads there, not to
    # a 404 page.
    path("", RedirectView.as_view(pattern_name="admin:index", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/", include("tasks.urls")),
    path("metrics", metrics_view, name="metrics"),
]
