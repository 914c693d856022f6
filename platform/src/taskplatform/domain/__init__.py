"""The platform's vocabulary: execution states and their transitions, and policy values.

Owns: ``states`` (the one table of states and legal transitions, with who may perform each)
and ``policies`` (misfire policies, the attempts cap, error-class resolution).
May import: ``conf``, ``exceptions`` and Django's utilities. Nothing here does I/O or loads
Celery; everything above (models, core, worker, scheduling, console) may import it.
"""
