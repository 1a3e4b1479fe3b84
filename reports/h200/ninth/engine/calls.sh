#!/usr/bin/env bash
# Ninth session, call 4: the engine's decode step on the H200 (after the kit's part 4 is installed).
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
# 1. as overlap_mps runs it (under colora's MPS daemon), vLLM's sampler, with the profiler
OUT=$OUT/a timeout $(left) bash scripts/h200.sh engine experiments/reference8_throughput.toml --profile
echo "A done at $(( $(date +%s) - T0 )) s"
# 2. the dedicated arm's engine (no MPS)
OUT=$OUT/b timeout $(left) bash scripts/h200.sh engine experiments/reference8_throughput.toml --set experiment.arm=dedicated
echo "B done at $(( $(date +%s) - T0 )) s"
# 3. colora's sampler under MPS
[ $(left) -gt 120 ] && COLORA_VLLM_SAMPLER=colora OUT=$OUT/c timeout $(left) bash scripts/h200.sh engine experiments/reference8_throughput.toml
echo "C done at $(( $(date +%s) - T0 )) s"
