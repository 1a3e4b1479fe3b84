#!/usr/bin/env bash
# Ninth session: branch next/trainer-kernels (unpacked in .carry/tk) on the H200: GPU tests, kernels, trainer step.
set -u
cd "$(dirname "$0")/../tk"
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
OUT=$OUT bash scripts/h200.sh tests
echo "tests done at $(( $(date +%s) - T0 )) s"
OUT=$OUT timeout 120 bash scripts/h200.sh cli bench kernels --only reduce --only rope --out $OUT/kernels
echo "kernels done at $(( $(date +%s) - T0 )) s"
OUT=$OUT timeout $(left) bash scripts/h200.sh trainer --impls triton+packed+fused triton+packed+fused+rope --peft-micro-seqs 32 --profile
echo "trainer done at $(( $(date +%s) - T0 )) s"
