"""Benchmarks: taskplatform against plain Celery and its peers, in one run (`make bench`)."""
