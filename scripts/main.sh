#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded (process) backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tenon doctor
# The trace replay (issue 4) replaces this once the backends and controller land.
.venv/bin/tenon image build
