"""The reference pages written from the code: the public API and the system checks.

    .venv/bin/python -m taskplatform.reference api > docs/reference/api.md
    .venv/bin/python -m taskplatform.reference checks > docs/reference/checks.md

(with ``DJANGO_SETTINGS_MODULE`` set). ``tests/unit/test_reference_docs.py`` keeps each page equal
to what this writes, so a changed signature or docstring without its page fails the build.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

#: The public API, by import path: module, then the names a project uses from it (with, for a
#: class, the members documented on the page).
PUBLIC: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    (
        "taskplatform",
        (("submit", ()), ("submit_or_get", ()), ("submit_many", ()), ("schedule_job", ())),
    ),
    ("taskplatform.api", (("SubmitManyResult", ("created_count",)),)),
    (
        "taskplatform.tasks",
        (
            (
                "IdempotentTask",
                ("execution", "idempotency_key", "fencing_token", "lease_lost", "derive_idempotency_key", "retry"),
            ),
        ),
    ),
    ("taskplatform.task_backend", (("LedgerBackend", ()), ("LedgerTask", ()))),
    ("taskplatform.beat", (("LockedScheduler", ()),)),
    (
        "taskplatform.jobs",
        (("define_job", ()), ("set_enabled", ()), ("duplicate_job", ()), ("delete_job", ()), ("validate", ())),
    ),
    (
        "taskplatform.http",
        (
            ("json_body", ()),
            ("idempotency_key_of", ()),
            ("error_response", ()),
            ("execution_payload", ()),
            ("submission_response", ()),
        ),
    ),
    ("taskplatform.backends", (("get_lock_backend", ()), ("LockBackend", ("acquire", "renew", "release", "inspect")))),
    ("taskplatform.tracing", (("setup", ()),)),
)


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(undocumented)"


def api_markdown() -> str:
    """``docs/reference/api.md``."""
    lines = [
        "# Public API reference",
        "",
        "Written from the code's signatures and docstrings (`python -m taskplatform.reference api`);",
        "a test keeps this page equal to the code. Anything not listed here is internal and may",
        "change without notice. The settings: `settings.md`; states and transitions: `states.md`;",
        "system checks: `checks.md`; metrics: `../metrics.md`.",
    ]
    for module_name, names in PUBLIC:
        module = importlib.import_module(module_name)
        lines += ["", f"## `{module_name}`"]
        for name, members in names:
            obj = getattr(module, name)
            title = f"class `{name}`" if inspect.isclass(obj) else f"`{name}{_signature(obj)}`"
            lines += ["", f"### {title}", "", _doc(obj)]
            for member in members:
                attribute = inspect.getattr_static(obj, member)
                if isinstance(attribute, property):
                    lines += ["", f"#### `{name}.{member}` (property)", "", _doc(attribute)]
                else:
                    function = getattr(obj, member)
                    lines += ["", f"#### `{name}.{member}{_signature(function)}`", "", _doc(function)]
    lines += [
        "",
        "## `taskplatform.exceptions`",
        "",
        "Every error the platform raises derives from `TaskPlatformError`:",
        "",
    ]
    lines += _exception_tree()
    return "\n".join(lines) + "\n"


def _exception_tree() -> list[str]:
    from . import exceptions

    classes = [
        obj
        for obj in vars(exceptions).values()
        if inspect.isclass(obj)
        and issubclass(obj, exceptions.TaskPlatformError)
        and obj.__module__ == exceptions.__name__
    ]

    def depth(cls: type) -> int:
        return next(i for i, base in enumerate(cls.__mro__) if base is exceptions.TaskPlatformError)

    lines = []
    for cls in sorted(classes, key=lambda c: [b.__name__ for b in reversed(c.__mro__[: depth(c) + 1])]):
        summary = _doc(cls).split("\n\n")[0].replace("\n", " ")
        lines.append(f"{'  ' * depth(cls)}- `{cls.__name__}`: {summary}")
    return lines


def checks_markdown() -> str:
    """``docs/reference/checks.md``."""
    from .checks import CHECKS

    lines = [
        "# System checks reference",
        "",
        "What `manage.py check` (and every `runserver`, `migrate` and worker start) reports about a",
        "configuration, written from `taskplatform.checks.CHECKS` (`python -m taskplatform.reference",
        "checks`). Errors stop `manage.py` commands; a worker or beat also refuses to start with a",
        "settings error (E002). A warning that is intended is silenced the Django way:",
        '`SILENCED_SYSTEM_CHECKS = ["taskplatform.W012"]`.',
        "",
        "| id | level | what it reports |",
        "|---|---|---|",
    ]
    for check_id, summary in sorted(CHECKS.items()):
        level = "error" if check_id.split(".")[1].startswith("E") else "warning"
        lines.append(f"| `{check_id}` | {level} | {summary} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    import django

    django.setup()
    pages = {"api": api_markdown, "checks": checks_markdown}
    if len(argv) != 1 or argv[0] not in pages:
        raise SystemExit(f"usage: python -m taskplatform.reference {{{','.join(pages)}}}")
    sys.stdout.write(pages[argv[0]]())


if __name__ == "__main__":
    main(sys.argv[1:])
