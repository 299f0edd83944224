#!/usr/bin/env bash
# Runs the tests marked vm inside the cgroup v2 test VM (a real kernel with a pure v2 hierarchy,
# every controller enabled, and sched_ext). Builds and caches the guest on first use.
# The results come back in the io directory: junit.xml and pytest's output (output.log).
# Usage: scripts/vm/test.sh [PYTEST ARGS...]   (no arguments: every test file marked vm)   (TENON_VM_IO=DIR keeps the results there)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
io="${TENON_VM_IO:-$(mktemp -d /tmp/tenon-vm-io.XXXXXX)}"
mkdir -p "$io"
echo "[vm test] results and logs: $io" >&2
# Collect only the files that hold vm tests: importing the whole suite under emulation takes a minute.
# With arguments (test files, -k ...), pytest gets exactly those.
files=()
if [ $# -eq 0 ]; then
  mapfile -t files < <(cd "$repo" && grep -rlE "pytest\.mark\.vm|mark\.vm\b" tests --include='test_*.py' | sort)
  [ "${#files[@]}" -gt 0 ] || { echo "vm test: no test file is marked vm" >&2; exit 1; }
fi
bash "$here/run.sh" --io "$io" --timeout "${TENON_VM_TIMEOUT:-2400}" -- \
  bash -c 'set -o pipefail; "$0"/.venv/bin/pytest -q -m vm -p no:cacheprovider --junitxml=/mnt/io/junit.xml "$@" 2>&1 | tee /mnt/io/output.log' \
  "$repo" "${files[@]}" "$@"
