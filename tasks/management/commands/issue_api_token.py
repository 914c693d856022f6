"""``manage.py issue_api_token <username> <name>``: print a new API token (shown once)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks.models import ApiToken


class Command(BaseCommand):
    help = "Issue an API token for a user; the key is printed once and only its hash is stored."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("name", help="What the token is for, e.g. 'checkout-service'.")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        _token, raw = ApiToken.issue(user, options["name"])
        self.stdout.write(raw)
