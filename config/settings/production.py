"""Production: every secret and address from the environment, secure cookies."""

from __future__ import annotations

import os

from .base import *  # noqa: F403
from .base import LOGGING, MIDDLEWARE, env_bool

SECRET_KEY = os.environ["DJANGO_SECRET_KEY"]
TASKPLATFORM_LOG_FORMAT = os.environ.get("TASKPLATFORM_LOG_FORMAT", "json")
LOGGING["handlers"]["console"]["formatter"] = TASKPLATFORM_LOG_FORMAT
DEBUG = False
SESSION_COOKIE_SECURE = env_bool("DJANGO_SECURE_COOKIES", True)
CSRF_COOKIE_SECURE = env_bool("DJANGO_SECURE_COOKIES", True)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# Behind a TLS-terminating proxy: trust its X-Forwarded-Proto (gunicorn only passes it on from
# FORWARDED_ALLOW_IPS) and accept form posts from the public origin(s).
if env_bool("DJANGO_BEHIND_TLS_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]
# The admin's static files, collected into the image (docker/Dockerfile), served by WhiteNoise.
MIDDLEWARE = [MIDDLEWARE[0], "whitenoise.middleware.WhiteNoiseMiddleware", *MIDDLEWARE[1:]]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
