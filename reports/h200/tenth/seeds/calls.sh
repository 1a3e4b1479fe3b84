#!/usr/bin/env bash
# Tenth session, arms: seeds 2, 3, 1 (three calls, in that order, on one machine, after packed_ab/):
# dedicated + overlap_mps with packed rows (COLORA_PACKED_ROWS=1, every arm) and micro-batches of
# 49,152 tokens (--set, every arm), each seed in its own call of scripts/h200.sh (kit installed).
set -u
cd "$(dirname "$0")/../../../.."
export COLORA_PACKED_ROWS=1
for s in 2 3 1; do
  rm -rf /tmp/colora-runs
  ARMS_NAME=pr_seed$s bash scripts/h200.sh arms experiments/reference8_throughput.toml --arms dedicated overlap_mps \
    --seeds $s --dedicated-steps 4 --set trainer.micro_batch_tokens=49152 --deadline 560 --runs /tmp/colora-runs/pr_seed$s
done
