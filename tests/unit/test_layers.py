"""The import-linter contracts hold on the tree, and they catch a wrong-way import.

The second test copies the platform's source to a temporary folder, adds one import that
breaks a contract, and runs ``lint-imports`` against the copy: if the contracts were
misconfigured (a layer missing, a contract that matches nothing), it would pass there too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAYERS = "The platform's layers import downwards only"


def lint_imports(pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_contracts_hold_on_the_tree() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("models.py", "from .worker import task as _wrong_way", LAYERS),
        ("core/ledger.py", "from ..scheduling import scheduler as _wrong_way", LAYERS),
        ("models.py", "import celery as _wrong_way", "The models import no Celery and no lock backend"),
        ("core/rescuer.py", "import tasks.tasks as _wrong_way", "never imports the reference deployment"),
        ("worker/owner.py", "from . import task as _cycle", "No import cycle"),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    copy = tmp_path / "taskplatform"
    shutil.copytree(ROOT / "platform" / "src" / "taskplatform", copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in " ".join(broken.split()), result.stdout
