#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole test suite
# (real redis-server, real API and worker processes). Extra arguments go to pytest. Two pytest
# processes, a test file at a time each (a module's stack stays one), since most of a test's time
# is spent waiting on its processes; the 25 slowest tests are listed at the end: CI's budget is 30
# minutes on 2 cores.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
