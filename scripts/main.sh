#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded (process) backend: a replay of
# the real AgentCgroup agent traces under a memory budget, Tenon against eager execution.
# A short version of the recorded bench (bench/results/README.md): 45 workflows submitted
# in 5 s against a 2 GiB budget (3.4x oversubscribed), model waits and durations sped up
# 10x, with the recorded bench's settings: 5% pressure regions (the default 12.5% each,
# with the 256 MiB safety margin, keep 768 MiB of a 2 GiB budget out of free use) and 8
# teardowns/rebuilds in flight. About 3-4 minutes; extra arguments go to `tenon bench`
# (e.g. --policies ..., or --set red_fraction=0.125 --set yellow_fraction=0.125).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tenon doctor
exec .venv/bin/tenon bench --trace bench/traces/agentcgroup-haiku.jsonl --budget 2GiB \
  --backend process --speed 10 --qps 9 --window 5s --policies tenon,eager \
  --set red_fraction=0.05 --set yellow_fraction=0.05 --set lifecycle_limit=8 \
  --out "bench/runs/main-$(date +%Y%m%d-%H%M%S)" "$@"
