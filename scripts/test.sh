#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite against the real kernel and Docker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
# In CI (CI=true) a test marked docker/cgroups/sandbox that would skip fails instead (tests/conftest.py).
exec .venv/bin/pytest -q "$@"
