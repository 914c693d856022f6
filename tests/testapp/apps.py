from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """A fault point for the fault catalogue, only when ``TP_FAULT_AT`` is set (``faults.py``)."""
        from .faults import install_from_environment

        install_from_environment()
