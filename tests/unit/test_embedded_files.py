"""The embedded profile's files: the SQLite database is private to its owner, like the secrets.

``make run`` keeps the database in ``var/db.sqlite3``; it holds password hashes, API token
hashes and every job's arguments, so it (and its ``-wal`` / ``-shm`` files) must not be
readable by other users of the machine, whatever the umask of the shell that started it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Migrate the embedded database, then report the modes of its files while a connection
#: holds them open (the -wal and -shm files exist only then).
PROBE = """
import json, os, stat, sys
import django
django.setup()
from django.core.management import call_command
from django.db import connection
call_command("migrate", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE IF NOT EXISTS probe (x integer)")
    cursor.execute("INSERT INTO probe VALUES (1)")
    path = connection.settings_dict["NAME"]
    modes = {
        suffix: oct(stat.S_IMODE(os.stat(path + suffix).st_mode))
        for suffix in ("", "-wal", "-shm")
        if os.path.exists(path + suffix)
    }
print(json.dumps({"path": str(path), "modes": modes}))
"""


def embedded_env(var_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "DJANGO_SETTINGS_MODULE"}}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings.local",
        TASKPLATFORM_VAR_DIR=str(var_dir),
        DJANGO_SECRET_KEY="test-only-secret",
        CELERY_BROKER_URL="memory://",
    )
    return env


def test_the_embedded_database_and_its_wal_files_are_private_despite_a_permissive_umask(tmp_path: Path) -> None:
    var_dir = tmp_path / "var"
    done = subprocess.run(
        [sys.executable, "-c", f"import os; os.umask(0o022); exec({PROBE!r})"],
        cwd=ROOT, env=embedded_env(var_dir), capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["path"] == str(var_dir / "db.sqlite3")
    assert set(report["modes"]) == {"", "-wal", "-shm"}, report
    assert report["modes"] == {"": "0o600", "-wal": "0o600", "-shm": "0o600"}, report


def test_an_existing_world_readable_database_is_made_private(tmp_path: Path) -> None:
    """A checkout whose var/db.sqlite3 was created before the fix is tightened on next start."""
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    database = var_dir / "db.sqlite3"
    database.touch()
    database.chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT, env=embedded_env(var_dir), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert stat.S_IMODE(database.stat().st_mode) == 0o600


def test_run_embedded_starts_everything_under_a_private_umask() -> None:
    """bin/run-embedded's processes create logs, broker files and sockets under ``var/`` too."""
    script = (ROOT / "bin" / "run-embedded").read_text()
    umask_at = script.index("umask 077")
    assert umask_at < script.index("manage.py migrate") and umask_at < script.index("celery -A config worker")
