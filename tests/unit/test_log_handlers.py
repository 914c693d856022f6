"""Celery's worker and beat handlers get the execution fields in any project (``apps``), and a
host's own formatter survives unless the host named the platform's format itself."""

from __future__ import annotations

import logging

from celery.utils.log import ColorFormatter
from django.test import override_settings

from taskplatform.apps import structured_celery_logs
from taskplatform.observability.logs import ExecutionContextFilter


def handlers() -> tuple[logging.Logger, logging.Handler, logging.Handler]:
    logger = logging.Logger("celery-like")
    celerys, hosts = logging.StreamHandler(), logging.StreamHandler()
    celerys.setFormatter(ColorFormatter("[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"))
    hosts.setFormatter(logging.Formatter('{"msg": "%(message)s"}'))  # a host's JSON for its shipper
    logger.addHandler(celerys)
    logger.addHandler(hosts)
    return logger, celerys, hosts


def test_celerys_default_formatter_is_replaced_and_a_hosts_own_is_kept() -> None:
    logger, celerys, hosts = handlers()
    with override_settings():
        from django.conf import settings

        del settings.TASKPLATFORM_LOG_FORMAT  # a project that never named the platform's format
        structured_celery_logs(logger=logger)
    assert "execution=%(execution_id)s" in str(celerys.formatter._fmt)  # type: ignore[union-attr]
    assert hosts.formatter._fmt == '{"msg": "%(message)s"}'  # type: ignore[union-attr]
    assert all(any(isinstance(f, ExecutionContextFilter) for f in h.filters) for h in (celerys, hosts))


@override_settings(TASKPLATFORM_LOG_FORMAT="plain")
def test_a_host_that_names_the_format_gets_it_on_every_handler() -> None:
    logger, celerys, hosts = handlers()
    structured_celery_logs(logger=logger)
    assert all("execution=%(execution_id)s" in str(h.formatter._fmt) for h in (celerys, hosts))  # type: ignore[union-attr]
