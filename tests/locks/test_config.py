"""Lock backend configuration: URLs, the CACHES-like setting, start-up checks."""

from __future__ import annotations

import pytest
from django.test import override_settings

from taskplatform.backends import get_lock_backend, parse_lock_url
from taskplatform.backends.db import DatabaseLockBackend
from taskplatform.backends.redis import RedisLockBackend
from taskplatform.backends.redis_cluster import RedisClusterLockBackend
from taskplatform.backends.redlock import RedlockLockBackend
from taskplatform.checks import check_lock_backends
from taskplatform.exceptions import ConfigurationError


@pytest.mark.parametrize(
    ("url", "cls", "options"),
    [
        ("db://", DatabaseLockBackend, {}),
        ("redis://h:6390/2", RedisLockBackend, {"url": "redis://h:6390/2"}),
        ("redis-cluster://h:7000", RedisClusterLockBackend, {"url": "redis://h:7000"}),
        ("redlock://a:1,b:2,c:3", RedlockLockBackend, {"urls": ["redis://a:1/0", "redis://b:2/0", "redis://c:3/0"]}),
    ],
)
def test_lock_urls_select_the_backend_and_its_options(url, cls, options):
    with override_settings(TASKPLATFORM_LOCK_URL=url):
        backend = get_lock_backend()
        assert type(backend) is cls
        for key, value in options.items():
            assert backend.options[key] == value


def test_the_database_backend_is_the_default():
    assert type(get_lock_backend()) is DatabaseLockBackend


def test_an_unknown_scheme_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="unknown scheme 'zookeeper'"):
        parse_lock_url("zookeeper://h:2181")


@override_settings(
    TASKPLATFORM_LOCK_BACKENDS={
        "default": {
            "BACKEND": "taskplatform.backends.redlock.RedlockLockBackend",
            "OPTIONS": {"urls": ["redis://a:1"]},
        },
        "broken": {"BACKEND": "nowhere.Backend"},
        "odd": {"OPTIONS": {}},
    }
)
def test_bad_backend_configuration_is_refused_at_start_up_with_what_to_change():
    messages = {m.id: [] for m in check_lock_backends()}
    for m in check_lock_backends():
        messages[m.id].append(m.msg)
    assert any("at least 3 independent nodes" in msg for msg in messages["taskplatform.E021"])
    assert any("cannot import 'nowhere.Backend'" in msg for msg in messages["taskplatform.E020"])
    assert any("needs a 'BACKEND' dotted path" in msg for msg in messages["taskplatform.E020"])
