"""Side-effect oracles for the tests (never part of the platform)."""

from django.db import models


class Effect(models.Model):
    """Every committed effect of a body, with NO unique constraint: a second run of a body shows
    as a second row (a UNIQUE key would turn a double into an error and hide it)."""

    key = models.CharField(max_length=255, db_index=True)
    fencing_token = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)


class EffectRaw(models.Model):
    """Every attempt that reached the body, without a constraint: counts duplicate runs."""

    key = models.CharField(max_length=255, db_index=True)
    phase = models.CharField(max_length=32, default="started")
    pid = models.IntegerField()
    fencing_token = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)


class Gate(models.Model):
    """A flag a test flips to let a waiting task body continue (no sleeps as synchronisation)."""

    name = models.CharField(max_length=100, unique=True)
    open = models.BooleanField(default=False)


class Span(models.Model):
    """When each body run started and ended (the worker's ``time.time()``), with NO constraint:
    overlapping spans show how many bodies ran at once, and a second run of a key shows twice.
    A body killed mid-run keeps ``ended`` empty."""

    key = models.CharField(max_length=255, db_index=True)
    pid = models.IntegerField()
    fencing_token = models.BigIntegerField(default=0)
    started = models.FloatField()
    ended = models.FloatField(null=True)
