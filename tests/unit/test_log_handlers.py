"""Celery's worker and beat handlers get the execution fields in any project (``apps``), and a
host's own formatter survives unless the host named the platform's format itself."""

from __future__ import annotations

import logging

from celery.app.defaults import DEFAULT_PROCESS_LOG_FMT
from celery.utils.log import ColorFormatter
from django.test import override_settings

from taskplatform.apps import structured_celery_logs
from taskplatform.observability.logs import ExecutionContextFilter

HOSTS_CELERY_FORMAT = "%(levelname)s %(processName)s %(message)s"  # CELERY_WORKER_LOG_FORMAT


def handlers() -> tuple[logging.Logger, logging.Handler, logging.Handler, logging.Handler]:
    logger = logging.Logger("celery-like")
    celerys, hosts, hosts_celery = logging.StreamHandler(), logging.StreamHandler(), logging.StreamHandler()
    celerys.setFormatter(ColorFormatter(DEFAULT_PROCESS_LOG_FMT))
    hosts.setFormatter(logging.Formatter('{"msg": "%(message)s"}'))  # a host's JSON for its shipper
    # What Celery installs for a host that set its own format: Celery's class, the host's format.
    hosts_celery.setFormatter(ColorFormatter(HOSTS_CELERY_FORMAT))
    for handler in (celerys, hosts, hosts_celery):
        logger.addHandler(handler)
    return logger, celerys, hosts, hosts_celery


def test_celerys_default_formatter_is_replaced_and_a_hosts_own_is_kept() -> None:
    logger, celerys, hosts, hosts_celery = handlers()
    with override_settings():
        from django.conf import settings

        del settings.TASKPLATFORM_LOG_FORMAT  # a project that never named the platform's format
        structured_celery_logs(logger=logger)
    assert "execution=%(execution_id)s" in str(celerys.formatter._fmt)  # type: ignore[union-attr]
    assert hosts.formatter._fmt == '{"msg": "%(message)s"}'  # type: ignore[union-attr]
    assert hosts_celery.formatter._fmt == HOSTS_CELERY_FORMAT  # type: ignore[union-attr]
    assert all(any(isinstance(f, ExecutionContextFilter) for f in h.filters) for h in (celerys, hosts, hosts_celery))


@override_settings(TASKPLATFORM_LOG_FORMAT="plain")
def test_a_host_that_names_the_format_gets_it_on_every_handler() -> None:
    logger, *every = handlers()
    structured_celery_logs(logger=logger)
    assert all("execution=%(execution_id)s" in str(h.formatter._fmt) for h in every)  # type: ignore[union-attr]
