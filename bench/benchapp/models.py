"""The benchmark's own table: the effect the ``write`` body leaves, one row per run."""

from __future__ import annotations

from django.db import models


class BenchEffect(models.Model):
    """A row written by one run of the ``write`` body. No unique constraint on purpose: a task
    run twice leaves two rows, so counting rows checks that each task ran exactly once."""

    i = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"effect {self.i}"


class BenchFloor(models.Model):
    """The ``floor`` variant's record of a task: inserted RUNNING, then updated SUCCEEDED."""

    i = models.IntegerField()
    state = models.CharField(max_length=16)
    created_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"floor {self.i} {self.state}"
