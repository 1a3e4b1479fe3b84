# The sixteenth session's device calls, in order (one H200, no vLLM kit: the kernels and the trainer need
# none). Each call's files are in the folders named beside it. r64_probe.py's PROBE picks the variant set.
# Shim first in every call: COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help

# 1. probe7/, probe7_r16/, ncu/ (a working tree: 562e7d4's kernel except that the partials' row step was
#    passed as a host int, so the compiler could not prove 16-byte alignment: the per-tile stores and the
#    atomic additions were scalar, not 128-bit): the dy pass with its dB partials added atomically into one
#    fp32 partial a job, 64- to 512-row tiles, against the per-tile partials and the dy read twice (rank 64's
#    default then); then Nsight Compute (ncu, --clock-control none) on one step of k/v and gate/up, rank 64
mkdir -p $OUT/probe7 $OUT/probe7_r16 $OUT/ncu
OUT=$OUT/probe7 PROBE=7 PYTHONPATH=/tmp/colora-shim timeout 260 python3 -P reports/h200/sixteenth/r64_probe.py
OUT=$OUT/probe7_r16 RANK=16 SHAPES=k/v,gate/up PROBE=7 PYTHONPATH=/tmp/colora-shim timeout 90 python3 -P reports/h200/sixteenth/r64_probe.py
SHAPES=k/v,gate/up NCU=1 PYTHONPATH=/tmp/colora-shim timeout 150 ncu --clock-control none --profile-from-start off \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
  --section SchedulerStats --section LaunchStats python3 -P reports/h200/sixteenth/r64_probe.py > $OUT/ncu/r64.txt

# 2. probe8/, probe8_r16/, kernels_lora/ (at 562e7d4: the atomic partials 128-bit, RED.E.ADD.F32x4, and
#    the default): against the dy read twice and the per-tile partials, ranks 64 and 16, every shape;
#    then the LoRA table of this tree
OUT=$OUT/probe8 PROBE=8 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P reports/h200/sixteenth/r64_probe.py
OUT=$OUT/probe8_r16 RANK=16 PROBE=8 PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P reports/h200/sixteenth/r64_probe.py
COLORA_TIMEOUT=170 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora

# 3. trainer_ab/ (.ab/base = git archive a099bda, the session's start, carried; against 562e7d4): the
#    trainer step (8 jobs x 64 sequences x 384 tokens, rank 16, the default impl), each tree in its own
#    process, 5 steps after a warm-up; then the GPU tests at 562e7d4 (trainer_ab/new/tests.log)
OUT=/tmp/ab/base timeout 200 bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new timeout 200 bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5 --profile
OUT=/tmp/ab/new timeout 170 bash scripts/h200.sh tests

# 4. probe9/, probe9_r16/ (at a1263ea, reverted in 930e74f): the shrink's x tiles loaded and its fused
#    expand's whole y tiles stored by the tensor-memory accelerator (launch override shrink "tma"), rank 64
#    every shape, rank 16 at q, o and gate/up. (A fifth call, 0.2 s, ran nothing: its script was not in
#    the working tree.)
OUT=$OUT/probe9 PROBE=9 PYTHONPATH=/tmp/colora-shim timeout 240 python3 -P reports/h200/sixteenth/r64_probe.py
OUT=$OUT/probe9_r16 RANK=16 SHAPES=q,o,gate/up PROBE=9 PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P reports/h200/sixteenth/r64_probe.py

# 5. kernels_tune/ (at 930e74f: 562e7d4's kernels): the launch search over the rank-64 problems and k/v
#    rank 16, the fused dy pass's candidates now searched at q, k/v and gate/up rank 64
COLORA_TIMEOUT=280 bash scripts/h200.sh cli bench kernels --only tune --tune-budget 240 --out $OUT/kernels_tune

# 6. probe10/, probe10_r16/, kernels_lora_final/, tests/ (at e7c2012, the final kernel code): the dy
#    pass's dx expand columns at rank 64 (128, the search's choice, against 32 before and 64), the forward
#    shrink's stages at rank 16 (information: not changed), the LoRA table, and the GPU tests
OUT=$OUT/probe10 SHAPES=q,k/v,gate/up PROBE=10 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/sixteenth/r64_probe.py
OUT=$OUT/probe10_r16 RANK=16 PROBE=10 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/sixteenth/r64_probe.py
COLORA_TIMEOUT=150 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora
OUT=$OUT/tests timeout 170 bash scripts/h200.sh tests

# 7. ncu_final/ (at 0a574b0, the final code): Nsight Compute on one step of k/v and gate/up at rank 64
#    and of k/v at rank 16, the launchers' own choices (the dy pass with its atomic dB included)
mkdir -p $OUT/ncu_final
for R in 64 16; do S=$([ $R = 64 ] && echo k/v,gate/up || echo k/v)
  RANK=$R SHAPES=$S NCU=1 PYTHONPATH=/tmp/colora-shim timeout 150 ncu --clock-control none --profile-from-start off \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section SchedulerStats --section LaunchStats python3 -P reports/h200/sixteenth/r64_probe.py > $OUT/ncu_final/r$R.txt 2>&1
done

# 8. probe11/ (at c33de06, the final kernel code): the rank-64 dy pass (dB fused) on 16 warps, and on
#    BLOCK_K 32 x 4 stages: none faster than its own 8 warps, BLOCK_K 64 x 3
OUT=$OUT/probe11 SHAPES=q,k/v,gate/up PROBE=11 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P reports/h200/sixteenth/r64_probe.py

# 9. tests_final/ (at f8ef679, the final code: fuse_dy_pays keeps fp32 rank 64 unfused): the GPU tests
#    (172 + 2 passed, 1 skipped: the vLLM-LoRA tuning test, no kit on the host)
OUT=$OUT/tests_final timeout 215 bash scripts/h200.sh tests
