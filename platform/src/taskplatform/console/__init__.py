"""The operator console: the Django admin pages and the interventions they offer.

Owns: ``admin`` (the ModelAdmins: executions, jobs, locks, audit), ``interventions`` (retry,
cancel, mark failed or done, run now, force-release a lock: legal, reasoned, audited),
``forms`` (the job form with its schedule and preview) and ``overview`` (the landing
section's counts and chart). HTML lives in ``templates/admin/taskplatform/``, colours in
``static/taskplatform/console.css`` (light and dark themes).

May import everything below it: ``api``, ``jobs``, ``scheduling.slots``, ``core``,
``backends``, ``observability``, ``models``, ``domain``, ``conf``, ``exceptions``. Nothing
imports the console except Django's hooks (``taskplatform.admin``, the template tag).
"""
