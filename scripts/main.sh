#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded (process) backend: a replay of
# the real AgentCgroup agent traces at 8x memory oversubscription (160 workflows whose peaks
# sum to 8x a 3 GiB budget, submitted over 10 s, model waits and durations sped up 10x).
# Five policies run in turn on the same host: the floor (`unconstrained`: no memory limit),
# Tenon, eager, the best static limit measured here (16 workflows at once) and peak
# reservation. About 16 minutes on 2 cores; extra arguments go to `tenon bench`
# (e.g. --policies tenon,eager for a shorter run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tenon doctor
exec .venv/bin/tenon bench --trace bench/traces/agentcgroup-haiku.jsonl --budget 3GiB \
  --backend process --speed 10 --qps 16 --window 10s --set lifecycle_limit=8 \
  --policies unconstrained,tenon,eager,static-16,reservation \
  --out "bench/runs/main-$(date +%Y%m%d-%H%M%S)" "$@"
