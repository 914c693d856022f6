"""Scheduling: slot arithmetic and the locked beat that publishes each slot once.

Owns: ``slots`` (pure slot times: crontab in a time zone, anchored interval, one-off, misfire
plans), ``config`` (the beat's timing rules), ``leadership`` (the beat lease and the fence),
``table`` (the schedule rows as slot entries with cursors), ``scheduler``
(``LockedScheduler``: the tick loop and publication) and ``maintenance`` (the rescuer and pruning
thread, a candidate for the maintenance lease in the leading beat and in every worker).

May import: ``core`` (submission, ledger, rescuer), ``backends`` (the lease), ``observability``,
``models``, ``domain``, ``conf``, ``exceptions``, Celery and django-celery-beat. Never the
worker (a task is recognised by ``core.validation.is_idempotent``) or the console.
``CELERY_BEAT_SCHEDULER = "taskplatform.beat.LockedScheduler"`` is the documented alias.
"""
