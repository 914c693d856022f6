"""Plug-in lock backends, configured like Django's ``CACHES``.

    TASKPLATFORM_LOCK_BACKENDS = {
        "default": {"BACKEND": "taskplatform.backends.redis.RedisLockBackend",
                    "OPTIONS": {"url": "redis://10.0.0.5:6379/0"}},
    }

or, for the default alias, a URL: ``TASKPLATFORM_LOCK_URL = "redlock://h1:6379,h2:6379,h3:6379"``
(schemes ``db``, ``locmem``, ``redis``/``rediss``, ``redis-cluster``, ``redlock``). Without
either, the database backend is used. Backends are built once per alias and process.

This package is the lock layer: ``base`` is the interface (``LockBackend``, ``Lease`` with its
fencing token), each other module one technology (``<Tech>LockBackend``). It may import
``conf``, ``exceptions`` and (the database backend only) ``models``; client libraries such as
``redis`` are imported only here, lazily. The beat's leadership and the console use it; the
core never does.
"""

from __future__ import annotations

from functools import cache
from typing import Any
from urllib.parse import urlsplit

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..conf import platform_settings
from ..exceptions import ConfigurationError
from .base import Lease, LockBackend, LockInfo

__all__ = ["Lease", "LockBackend", "LockInfo", "backend_config", "get_lock_backend", "parse_lock_url"]

BACKENDS = {
    "db": "taskplatform.backends.db.DatabaseLockBackend",
    "locmem": "taskplatform.backends.locmem.LocMemLockBackend",
    "redis": "taskplatform.backends.redis.RedisLockBackend",
    "redis-cluster": "taskplatform.backends.redis_cluster.RedisClusterLockBackend",
    "redlock": "taskplatform.backends.redlock.RedlockLockBackend",
}


def parse_lock_url(url: str) -> dict[str, Any]:
    """A ``{"BACKEND": ..., "OPTIONS": ...}`` entry for a lock URL.

    >>> parse_lock_url("redlock://a:7001,b:7002,c:7003")["OPTIONS"]["urls"]
    ['redis://a:7001/0', 'redis://b:7002/0', 'redis://c:7003/0']
    >>> parse_lock_url("db://")["BACKEND"]
    'taskplatform.backends.db.DatabaseLockBackend'
    """
    scheme, _, rest = url.partition("://")
    if not _:
        raise ConfigurationError(f"lock URL {url!r} has no scheme (db://, redis://, redis-cluster://, redlock://)")
    if scheme in ("redis", "rediss", "unix"):
        return {"BACKEND": BACKENDS["redis"], "OPTIONS": {"url": url}}
    if scheme == "redis-cluster":
        return {"BACKEND": BACKENDS["redis-cluster"], "OPTIONS": {"url": f"redis://{rest}"}}
    if scheme == "redlock":
        hosts = [h.strip() for h in rest.split("/", 1)[0].split(",") if h.strip()]
        return {"BACKEND": BACKENDS["redlock"], "OPTIONS": {"urls": [f"redis://{h}/0" for h in hosts]}}
    if scheme == "db":
        alias = urlsplit(url).netloc
        return {"BACKEND": BACKENDS["db"], "OPTIONS": {"using": alias} if alias else {}}
    if scheme == "locmem":
        return {"BACKEND": BACKENDS["locmem"], "OPTIONS": {}}
    raise ConfigurationError(f"lock URL {url!r}: unknown scheme {scheme!r}; use one of {', '.join(BACKENDS)}")


def backend_config(alias: str) -> dict[str, Any]:
    """The configuration entry for ``alias``."""
    conf = platform_settings()
    configured = conf.lock_backends or {}
    if alias in configured:
        entry = configured[alias]
        if not isinstance(entry, dict) or "BACKEND" not in entry:
            raise ConfigurationError(f"TASKPLATFORM_LOCK_BACKENDS[{alias!r}] needs a 'BACKEND' dotted path")
        return entry
    if alias == "default":
        return parse_lock_url(conf.lock_url)
    raise ConfigurationError(f"no lock backend {alias!r} in TASKPLATFORM_LOCK_BACKENDS")


def build_backend(alias: str, entry: dict[str, Any]) -> LockBackend:
    try:
        cls = import_string(entry["BACKEND"])
    except ImportError as exc:
        raise ConfigurationError(f"lock backend {alias!r}: cannot import {entry['BACKEND']!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, LockBackend)):
        raise ConfigurationError(f"lock backend {alias!r}: {entry['BACKEND']!r} is not a LockBackend")
    backend: LockBackend = cls(alias, dict(entry.get("OPTIONS", {})))
    return backend


@cache
def get_lock_backend(alias: str = "default") -> LockBackend:
    """The lock backend configured under ``alias`` (built once per process)."""
    return build_backend(alias, backend_config(alias))


@receiver(setting_changed)
def _reset(setting: str, **kwargs: Any) -> None:
    if setting in ("TASKPLATFORM_LOCK_BACKENDS", "TASKPLATFORM_LOCK_URL"):
        get_lock_backend.cache_clear()
