#!/usr/bin/env bash
# Ninth session, arms: seed 2, dedicated + overlap_mps, main with COLORA_ENGINE_PROCESS unset (auto:
# overlap_mps's client in its own process, the dedicated baseline's in-process).
set -u
cd "$(dirname "$0")/../.."
unset COLORA_ENGINE_PROCESS
ARMS_NAME=seed2 bash scripts/h200.sh arms experiments/reference8_throughput.toml --arms dedicated overlap_mps \
  --seeds 2 --dedicated-steps 4 --deadline ${DEADLINE:-560} --runs /tmp/colora-runs/seed2
