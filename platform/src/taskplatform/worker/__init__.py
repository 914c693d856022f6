"""The worker side: the task base class every platform job runs through, and its policies.

Owns: ``task`` (``IdempotentTask``: claim → run → record, atomic mode, the lease heartbeat),
``retry`` (``RetryPolicy``: Celery's backoff options with the job's overrides), ``owner``
(the owner identity of an attempt and the dead-owner probe) and ``builtins`` (the
``taskplatform.rescue`` and ``taskplatform.trigger_job`` tasks).

May import: ``core``, ``observability``, ``models``, ``domain``, ``conf``, ``exceptions`` and
Celery. Users import ``IdempotentTask`` from ``taskplatform.tasks`` (the documented alias,
which is also the module Celery's autodiscovery loads).
"""
