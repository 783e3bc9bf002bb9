#!/usr/bin/env bash
# The main job: installs what is missing, starts a local stack (redis, API, one worker),
# generates a small random-weight model, submits the seed's GRPO job over HTTP, shows its
# progress live, prints the final job, and stops everything it started.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec .venv/bin/python scripts/demo.py "$@"
