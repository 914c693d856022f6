"""The package's metadata, as an index would show it (found adopting the built wheel)."""

from __future__ import annotations

import importlib.metadata as metadata
import tomllib
from pathlib import Path

import taskplatform

PYPROJECT = Path(__file__).resolve().parents[2] / "platform" / "pyproject.toml"


def test_the_version_is_written_once() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert metadata.version("taskplatform") == taskplatform.__version__


def test_the_package_description_names_every_extra() -> None:
    """``platform/README.md`` (the index page) listed four of the extras: a user of the
    django-tasks backend or of tracing could not find what to install."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    readme = (PYPROJECT.parent / "README.md").read_text()
    assert [name for name in extras if f"`{name}`" not in readme] == []


def test_every_imported_dependency_is_declared_and_django_is_not_capped_below_the_next_major() -> None:
    requires = metadata.requires("taskplatform") or []
    names = {r.split(";")[0].split("<")[0].split(">")[0].split("[")[0].strip().lower() for r in requires}
    assert {"django", "celery", "django-celery-beat", "cron-descriptor"} <= names
    (django,) = [r for r in requires if r.lower().startswith("django<") or r.lower().startswith("django>")]
    assert "<6.0" in django, django
    assert any(r.startswith("psycopg<") and 'extra == "postgres"' in r for r in requires), "postgres forces a build"
    assert len(metadata.metadata("taskplatform").get_all("Classifier") or []) >= 10
