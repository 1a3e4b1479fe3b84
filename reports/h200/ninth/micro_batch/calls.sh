#!/usr/bin/env bash
# Ninth session, last call: a group's training step of the overlap arm (4 jobs x 64 sequences x
# 40+113 tokens, as the reference workload's mean) in two micro-batches (32768 tokens) against one
# (65536), and one job's (the dedicated arm's); no vLLM needed.
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s)
for spec in "g4_mb32k 4 32768" "g4_mb64k 4 65536" "j1_mb32k 1 32768"; do
  set -- $spec
  left=$(( 215 - ($(date +%s) - T0) ))
  [ $left -gt 20 ] || break
  OUT=$OUT/$1 timeout $left bash scripts/h200.sh trainer --impls triton+packed+fused --jobs $2 --prompt 40 \
    --completion 113 --micro-batch-tokens $3 --repeats 5 | grep -E "^\||seconds"
  echo "$1 done at $(( $(date +%s) - T0 )) s"
done
