"""The soak's oracle: raw side-effect tables with NO unique constraint.

A body that runs twice leaves two ``SoakStart`` rows; an effect committed twice leaves two
``SoakEffect`` rows. A unique key would turn a double into an error and hide it.
"""

from __future__ import annotations

from django.db import models


class SoakStart(models.Model):
    """A body start, committed on a connection of its own (``oracle``), outside the ledger's
    transaction: an atomic body's start is counted even when its transaction rolls back.
    Recorded for planned failures and for every attempt after the first (not for first attempts
    that are meant to succeed: one commit less per execution on the soak's hot path)."""

    key = models.CharField(max_length=255, db_index=True)
    task = models.CharField(max_length=32)
    fencing_token = models.BigIntegerField()
    pid = models.IntegerField()
    #: This attempt raises the planned transient error (the first attempt of one body in ten).
    fails = models.BooleanField(default=False)
    #: The worker's ``time.time()`` at the start (fault windows are on the soak's wall clock).
    at = models.FloatField()

    def __str__(self) -> str:
        return f"start {self.key} #{self.fencing_token}"


class SoakEffect(models.Model):
    """One row per committed effect: inside the ledger's transaction for atomic bodies (so it
    exists if and only if the success does), in autocommit for the others."""

    key = models.CharField(max_length=255, db_index=True)
    task = models.CharField(max_length=32)
    fencing_token = models.BigIntegerField()
    pid = models.IntegerField()
    at = models.FloatField()

    def __str__(self) -> str:
        return f"effect {self.key} #{self.fencing_token}"
