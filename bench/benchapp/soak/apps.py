from django.apps import AppConfig


class SoakConfig(AppConfig):
    name = "bench.benchapp.soak"
    label = "soak"
    default_auto_field = "django.db.models.BigAutoField"
