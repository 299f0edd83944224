#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded (process) backend: a replay of
# the real AgentCgroup agent traces under a memory budget, Tenon against eager execution.
# A short version of the recorded bench (bench/results/README.md): 45 workflows submitted
# in 5 s against a 2 GiB budget (3.4x oversubscribed), model waits and durations sped up
# 10x. About 3-4 minutes; extra arguments go to `tenon bench` (e.g. --policies ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tenon doctor
exec .venv/bin/tenon bench --trace bench/traces/agentcgroup-haiku.jsonl --budget 2GiB \
  --backend process --speed 10 --qps 9 --window 5s --policies tenon,eager \
  --out "bench/runs/main-$(date +%Y%m%d-%H%M%S)" "$@"
