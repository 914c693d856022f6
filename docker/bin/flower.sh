#!/usr/bin/env bash
# Flower through the repository's bin/flower, which refuses to start without
# FLOWER_BASIC_AUTH (or FLOWER_AUTH). In the image Python is on PATH, not in .venv/, and
# Flower listens on all of the container's interfaces, port FLOWER_PORT (5555); the compose
# file publishes it on 127.0.0.1 of the host only.
set -euo pipefail
cd "$(dirname "$0")/../.."

export PYTHON="${PYTHON:-python}"
export FLOWER_ADDRESS="${FLOWER_ADDRESS:-0.0.0.0}"
exec bin/flower
