#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded (process) backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tenon doctor
# Until the trace replay (issue 4) lands, the main job is the residency demo.
exec .venv/bin/tenon demo --backend process --budget 512MiB "$@"
