#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite against the real kernel and Docker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
# In CI (CI=true) a test marked docker/cgroups/sandbox/vm that would skip fails instead
# (tests/conftest.py). The host runs every test but those marked vm; then the cgroup v2 test VM
# (scripts/vm/) boots and runs those. With arguments, only the host's pytest runs, with them.
if [ $# -gt 0 ]; then exec .venv/bin/pytest -q "$@"; fi
results="$(mktemp -d /tmp/tenon-tests.XXXXXX)"
host=0
.venv/bin/pytest -q --junitxml="$results/host.xml" || host=$?
vm=0
TENON_VM_IO="$results/vm" bash scripts/vm/test.sh || vm=$?
echo "host suite: exit $host; cgroup v2 VM suite: exit $vm (results: $results)"
# one closing line for both runs, from their JUnit reports
.venv/bin/python - "$results/host.xml" "$results/vm/junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        n["errors"] += 1
        continue
    for suite in root.iter("testsuite"):
        for key in n:
            n[key] += int(suite.get(key, 0))
failed = n["failures"] + n["errors"]
print(f"all: {n['tests'] - failed - n['skipped']} passed, {failed} failed, {n['skipped']} skipped")
PY
[ "$host" -eq 0 ] && [ "$vm" -eq 0 ]
