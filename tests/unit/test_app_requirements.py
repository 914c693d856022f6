"""What ``INSTALLED_APPS`` taskplatform needs is said plainly, not found through a traceback.

Found adopting the app into a fresh project: with only ``taskplatform`` installed,
``manage.py check`` failed with a traceback about a django-celery-beat model without an app
label, and without ``django.contrib.admin`` ``django.setup()`` failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SETTINGS = """
SECRET_KEY = "not-a-secret"
INSTALLED_APPS = {apps!r}
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}}}
"""


def setup_with(tmp_path: Path, apps: list[str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "adopting_settings.py").write_text(SETTINGS.format(apps=apps))
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "adopting_settings", "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); print('ready')"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("apps", "named"),
    [
        (["taskplatform"], "'django.contrib.admin', 'django.contrib.auth', 'django.contrib.contenttypes'"),
        (
            ["django.contrib.auth", "django.contrib.contenttypes", "django_celery_beat", "taskplatform"],
            "'django.contrib.admin' in INSTALLED_APPS",
        ),
    ],
)
def test_a_missing_required_app_is_named_at_setup(tmp_path: Path, apps: list[str], named: str) -> None:
    done = setup_with(tmp_path, apps)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: taskplatform needs") and named in last, last


def test_the_required_apps_are_enough(tmp_path: Path) -> None:
    apps = [
        "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions",
        "django.contrib.messages", "django_celery_beat", "taskplatform",
    ]  # fmt: skip
    done = setup_with(tmp_path, apps)
    assert done.returncode == 0 and done.stdout.strip() == "ready", done.stderr


FULL_APPS = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions",
    "django.contrib.messages", "django_celery_beat", "taskplatform",
]  # fmt: skip

#: A project's ``celery.py`` as Celery's guide writes it, with a task defined in it: the
#: package's ``__init__`` imports it before Django has loaded any app.
CELERY_PY_WITH_A_TASK = """
from celery import Celery
from taskplatform.tasks import IdempotentTask

app = Celery("adopting")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=IdempotentTask, bind=True, name="adopting.early")
def early(self, n):
    return n

import django

django.setup()
import sys
from types import ModuleType

from taskplatform.models import Execution

deferred = ["taskplatform.core.leases", "taskplatform.core.ledger", "taskplatform.core.submission"]
loaded = all(type(sys.modules[name]) is ModuleType for name in deferred)  # executed at ready(), not later
print("ready", early.name, isinstance(early, IdempotentTask), Execution._meta.label, loaded)
"""


def test_the_task_base_imports_before_django_setup(tmp_path: Path) -> None:
    (tmp_path / "adopting_settings.py").write_text(SETTINGS.format(apps=FULL_APPS))
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "adopting_settings", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", CELERY_PY_WITH_A_TASK], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ready", "adopting.early", "True", "taskplatform.Execution", "True"]
