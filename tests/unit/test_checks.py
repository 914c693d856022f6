"""Start-up checks refuse configurations that break the guarantees, and say what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import current_app
from django.test import override_settings

from taskplatform.checks import check_beat, check_celery, check_database, check_exposed_services, check_settings


@pytest.fixture
def celery_conf():
    conf = current_app.conf
    saved = {
        k: conf.get(k)
        for k in ("accept_content", "broker_transport_options", "task_serializer", "broker_url", "result_backend")
    }
    yield conf
    for key, value in saved.items():
        conf[key] = value


def ids(messages) -> set[str]:
    return {m.id for m in messages}


def test_the_shipped_configuration_passes():
    assert check_settings() == [] and check_celery() == [] and check_beat() == []


@override_settings(TASKPLATFORM_BEAT_LEASE_SECONDS=2.0, TASKPLATFORM_BEAT_TICK_SECONDS=1.0)
def test_a_beat_lease_below_three_ticks_is_refused_with_what_to_change():
    messages = check_beat()
    assert ids(messages) == {"taskplatform.E030"}
    assert any("Raise the lease to at least 3" in m.msg for m in messages)


@override_settings(TASKPLATFORM_BEAT_LEASE_SECONDS=15.0, TASKPLATFORM_BEAT_TICK_SECONDS=1.0)
def test_a_failover_above_ten_seconds_is_warned_about():
    assert ids(check_beat()) == {"taskplatform.W031"}


@pytest.mark.scenario(37)
def test_pickle_is_refused(celery_conf):
    unsafe = "pickle"  # what the check must refuse
    celery_conf.accept_content = ["json", unsafe]
    celery_conf.task_serializer = unsafe
    assert {"taskplatform.E010", "taskplatform.E011"} <= ids(check_celery())


def test_a_countdown_bound_above_half_the_visibility_timeout_is_refused(celery_conf):
    celery_conf.broker_transport_options = {"visibility_timeout": 100}
    messages = [m for m in check_celery() if m.id == "taskplatform.E013"]
    assert messages and "visibility_timeout" in messages[0].hint


@override_settings(TASKPLATFORM_LEASE_SECONDS=1)
def test_a_lease_too_short_to_renew_is_refused():
    messages = check_settings()
    assert ids(messages) == {"taskplatform.E003"} and "3 seconds or more" in messages[0].hint


@override_settings(TASKPLATFORM_REPUBLISH_AFTER_SECONDS=0)
def test_non_positive_values_are_refused():
    assert "taskplatform.E002" in ids(check_settings())


@override_settings(TASKPLATFORM_LEASE_SECOND=30)
def test_a_misspelt_setting_is_reported_with_the_nearest_valid_name():
    """``TASKPLATFORM_LEASE_SECOND`` used to be ignored silently (the lease stayed 60 s). A
    warning, not an error: a host may name settings of its own ``TASKPLATFORM_*``, and an error
    would stop its ``migrate``."""
    (message,) = [m for m in check_settings() if m.id == "taskplatform.W001"]
    assert "TASKPLATFORM_LEASE_SECOND" in message.msg and message.hint == "Did you mean TASKPLATFORM_LEASE_SECONDS?"
    assert not message.is_serious()


@override_settings(TASKPLATFORM_RESCUE_QUEUE="rescue")
def test_a_removed_setting_says_it_was_removed_not_a_near_name():
    """W001 used to answer ``TASKPLATFORM_RESCUE_QUEUE`` with "Did you mean
    TASKPLATFORM_RESCUE_BATCH_SIZE?", a setting that does something else."""
    (message,) = [m for m in check_settings() if m.id == "taskplatform.W001"]
    assert "TASKPLATFORM_RESCUE_QUEUE" in message.msg and "removed" in message.hint
    assert "Did you mean" not in message.hint and "BATCH_SIZE" not in message.hint


@override_settings(
    TASKPLATFORM_LEASE_SECONDS=60.0, TASKPLATFORM_MAX_BROKER_COUNTDOWN_SECONDS=0, TASKPLATFORM_RETENTION_DAYS=0,
    TASKPLATFORM_BEAT_CATCH_UP_WINDOW_SECONDS=0, TASKPLATFORM_PRUNE_INTERVAL_SECONDS=3600.0,
)  # fmt: skip
def test_values_that_worked_before_the_checks_still_work():
    """A whole float for an integer (read as the integer) and the zeros that mean something
    (park every delay in the ledger, keep every execution, no catch-up) are valid."""
    from taskplatform.conf import platform_settings

    assert check_settings() == []
    conf = platform_settings()
    assert conf.lease_seconds == 60 and type(conf.lease_seconds) is int and conf.max_broker_countdown_seconds == 0


@pytest.mark.parametrize(
    ("setting", "value", "fragment"),
    [
        ("TASKPLATFORM_BEAT_LEASE_SECONDS", "6", "must be a number, not '6' (str)"),
        ("TASKPLATFORM_LEASE_SECONDS", 30.5, "must be an integer, not 30.5"),
        ("TASKPLATFORM_LEASE_SECONDS", True, "must be an integer, not True"),
        ("TASKPLATFORM_PREPARED_STATEMENTS", "no", "must be True or False"),
        ("TASKPLATFORM_LOCK_BACKENDS", [], "must be a dict"),
        ("TASKPLATFORM_RETENTION_DAYS", -1, "must be 0 or more"),
        ("TASKPLATFORM_BEAT_TICK_SECONDS", 0, "must be above 0"),
        ("TASKPLATFORM_LOG_FORMAT", "xml", "must be one of 'plain', 'json'"),
        ("TASKPLATFORM_BEAT_TICK_SECONDS", float("nan"), "must be a finite number"),
        ("TASKPLATFORM_BEAT_LEASE_SECONDS", float("inf"), "must be a finite number"),
        ("TASKPLATFORM_MAX_KEY_LENGTH", 1000, "must be at most 255"),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_a_check_error_not_a_traceback(setting, value, fragment):
    """Every check runs (none raises on a string where a number belongs); the value is named;
    the worker and the beat, which read the settings, refuse to start with the same message."""
    from django.core.exceptions import ImproperlyConfigured

    from taskplatform.checks import check_lock_backends
    from taskplatform.conf import platform_settings

    with override_settings(**{setting: value}):
        messages = [*check_settings(), *check_celery(), *check_beat(), *check_lock_backends()]
        errors = [m for m in messages if m.id == "taskplatform.E002"]
        assert len(errors) == 1 and setting in errors[0].msg and fragment in errors[0].msg, messages
        with pytest.raises(ImproperlyConfigured, match=setting):
            platform_settings()
        from taskplatform.apps import refuse_bad_settings

        with pytest.raises(SystemExit, match=setting):  # a worker's ``worker_init``: it does not start
            refuse_bad_settings()


def test_a_global_celery_warning_can_be_silenced_the_django_way():
    """W012 and W015 are about the host's own Celery settings: ``SILENCED_SYSTEM_CHECKS`` says
    "I know", and the hints say so."""
    from django.core.management import call_command

    conf = current_app.conf
    saved = conf.task_acks_late
    conf.task_acks_late = False
    try:
        (warning,) = [m for m in check_celery() if m.id == "taskplatform.W012"]
        assert "SILENCED_SYSTEM_CHECKS" in warning.hint
        with override_settings(SILENCED_SYSTEM_CHECKS=["taskplatform.W012"]):
            call_command("check", fail_level="WARNING")  # would raise SystemCheckError on W012
    finally:
        conf.task_acks_late = saved


def test_the_settings_reference_page_is_the_code():
    """``docs/reference/settings.md`` is generated from ``PlatformSettings``: regenerate it with
    ``.venv/bin/python -m taskplatform.conf > docs/reference/settings.md``."""
    from taskplatform.conf import reference_markdown

    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "settings.md"
    assert page.read_text() == reference_markdown()


def test_the_ledger_on_sqlite_is_warned_about_and_other_databases_are_not():
    from django.db import connections

    expected = {"taskplatform.W016"} if connections["default"].vendor == "sqlite" else set()
    assert ids(check_database()) == expected


@pytest.mark.scenario(38)
@pytest.mark.parametrize(
    ("broker", "result", "lock", "refused"),
    [
        ("redis://10.1.2.3:6379/0", None, "db://", ["the broker"]),
        ("redis://:s3cret@10.1.2.3:6379/0", "redis://cache.internal/1", "db://", ["the result backend"]),
        ("amqp://guest:guest@mq.internal:5672//", None, "redis://locks.internal:6379/0", ["the broker", "lock"]),
        ("amqp://app:s3cret@mq.internal:5672//", None, "redis://:pw@locks.internal:6379/0", []),
        ("redis://127.0.0.1:6379/0", "redis://localhost/1", "redis://[::1]:6379/0", []),
    ],
)
def test_a_data_service_on_another_host_without_credentials_fails_the_deploy_check(
    celery_conf, monkeypatch, broker, result, lock, refused, figures
):
    monkeypatch.setenv("CELERY_BROKER_URL", broker)  # Celery reads the environment first
    monkeypatch.delenv("CELERY_RESULT_BACKEND", raising=False)
    celery_conf.broker_url = broker
    celery_conf.result_backend = result
    with override_settings(TASKPLATFORM_LOCK_URL=lock):
        messages = check_exposed_services()
    assert [m.id for m in messages] == ["taskplatform.E040"] * len(refused)
    for message, what in zip(messages, refused, strict=True):
        assert message.msg.startswith(what) and ("password" in message.msg or "guest" in message.msg)
    figures.record(exposed_urls=len(refused), refused=len(messages))


def test_the_exposure_check_runs_with_check_deploy_only():
    from django.core.checks import registry

    assert check_exposed_services in registry.registry.get_checks(include_deployment_checks=True)
    assert check_exposed_services not in registry.registry.get_checks(include_deployment_checks=False)


def test_a_rabbitmq_broker_is_used_with_publisher_confirms(monkeypatch):
    """Without confirms a crash of the RabbitMQ node lost recent persistent messages
    (tests/chaos/test_broker_faults.py); the settings turn them on for amqp URLs."""
    from config.settings.base import broker_from_env

    monkeypatch.setenv("CELERY_BROKER_URL", "amqp://app:pw@mq.internal:5672//")
    assert broker_from_env()[1].get("confirm_publish") is True
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    assert "confirm_publish" not in broker_from_env()[1]


def test_a_postgres_database_fails_fast_on_a_dead_connection(monkeypatch):
    """A silently cut connection must error within seconds, not hang a lease renewal."""
    from config.settings.base import database_from_env

    monkeypatch.setenv("DATABASE_URL", "postgres://app@db.internal:5432/app")
    options = database_from_env(Path("/nonexistent"))["OPTIONS"]
    assert options["tcp_user_timeout"] <= 15_000 and options["keepalives"] == 1
    assert options["keepalives_idle"] + options["keepalives_interval"] * options["keepalives_count"] <= 15
    assert options["connect_timeout"] <= 10


def test_tracing_without_its_packages_is_an_error_naming_them():
    from taskplatform.checks import check_tracing

    assert check_tracing() == []  # off by default
    with override_settings(TASKPLATFORM_TRACING="console"):
        assert check_tracing() == []  # the SDK and Celery's instrumentation are installed here
    with override_settings(TASKPLATFORM_TRACING="otlp"):  # the OTLP exporter is not
        messages = check_tracing()
    assert ids(messages) == {"taskplatform.E050"}
    assert "opentelemetry.exporter.otlp.proto.http" in messages[0].msg


def test_a_beat_lock_alias_that_names_no_backend_is_an_error():
    """The beat's alias also holds the maintenance lease, in workers too: a misnamed one would
    leave the fleet without a rescuer, and ``check`` must say so (review of issue 14)."""
    from taskplatform.checks import check_lock_backends

    with override_settings(TASKPLATFORM_BEAT_LOCK_ALIAS="locks"):
        errors = [m for m in check_lock_backends() if m.id == "taskplatform.E020"]
    assert len(errors) == 1 and "'locks'" in errors[0].msg, errors
