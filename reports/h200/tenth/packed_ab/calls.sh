#!/usr/bin/env bash
# Tenth session, first call after the kit: packed rows' GPU tests, then overlap_mps seed 1: main, packed rows with
# micro-batches of 49,152 tokens, and the same with reload-first, in one MPS process (one engine).
cd "$(dirname "$0")/../../../.."  # it ran as .carry/dev/a.sh, from the repository root
OUT=${OUT:-out}; mkdir -p "$OUT"
mkdir -p /tmp/colora-shim/colora
for f in "$PWD"/colora/*; do ln -sfn "$f" /tmp/colora-shim/colora/; done
ln -sfn "$PWD/kernels" /tmp/colora-shim/colora/kernels; ln -sfn "$PWD/tasks" /tmp/colora-shim/colora/tasks
export PYTHONPATH=/tmp/colora-shim:/tmp/colora-site:${PYTHONPATH:-} COLORA_HOME=/tmp/colora-home
timeout 150 python3 -P -m pytest -q tests/test_trainer.py -k "gpu" -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"; tail -5 "$OUT/tests.log"
ARMS_NAME=pr bash scripts/h200.sh arms experiments/reference8_throughput.toml --arms overlap_mps --seeds 1 \
  --vary env:COLORA_PACKED_ROWS=1+trainer.micro_batch_tokens=49152 \
  --vary env:COLORA_PACKED_ROWS=1+trainer.micro_batch_tokens=49152+env:COLORA_RELOAD_FIRST=1 \
  --deadline $((560 - SECONDS)) --runs /tmp/colora-runs/pr
