"""The soak's Django app (``bench/soak.py``): its tasks, its oracle tables and its settings.

Kept apart from ``bench.benchapp`` so that a soak needs only what ``make test`` installs: the
benchmark app's tasks import celery-once and Procrastinate (``requirements/bench.txt``), and
Celery's autodiscovery imports an installed app's ``tasks`` module.
"""
