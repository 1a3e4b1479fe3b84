#!/usr/bin/env bash
# Eleventh session (one H200, kit installed: part 1, then part 2 in the first call below), tree cce79b4.
# 1-3: one benchmark in three calls, each the same command on the same warm machine; a call skips the
#      runs a previous one finished (/tmp/colora-runs/five) and the deadline cuts what does not fit.
#      Call 3's deadline was 540 (calls 1-2: 555). Outputs: five/ (the report as call 3 left it,
#      arms_callN.log per call, runs/ = /tmp/colora-runs/five after call 3).
# 4-5: GPU tests (tests_trainer.log, tests_lora.log), in the device time left.
set -u
cd "$(dirname "$0")/../../.."
for call in 1 2 3; do
  ARMS_NAME=five bash scripts/h200.sh arms experiments/reference8_throughput.toml --seeds 1 --dedicated-steps 4 \
    --jobs 2 4 16 --vary env:COLORA_RELOAD_FIRST=0 --deadline 555 --runs /tmp/colora-runs/five
done
bash scripts/h200.sh tests  # what ran: the shim of scripts/h200.sh, then the two commands below
# timeout 115 python3 -P -m pytest -q tests/test_trainer.py -k gpu -p no:cacheprovider
# timeout 75 python3 -P -m pytest -q -m gpu tests/test_lora.py -p no:cacheprovider
