# The seventeenth session's device calls, in order (one H200, no vLLM kit: the kernels and the trainer need
# none). Each call's files are in the folders named beside it. r64_probe.py's PROBE picks the variant set;
# RANK, TPJ (tokens a job), PACKED=1 (the trainer's calls: q|k|v and gate|up packed) and BASE=1 (the frozen
# base projections inside the op) pick the problem. Shim first in every call:
#   COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help

# 1. probe12/, probe12_r16/ (at c64b51a): dx expanded in dA's pass (lora_sgrad's expand, route "sgrad") against
#    the dy pass (rank 64's own, and rank 16's where d_in <= d_out) or lora_expand; y by lora_expand_rows
#    (route "rows") against the shrink's launch; ranks 64 and 16, every shape
mkdir -p $OUT/probe12 $OUT/probe12_r16
OUT=$OUT/probe12 PROBE=12 PYTHONPATH=/tmp/colora-shim timeout 330 python3 -P reports/h200/seventeenth/r64_probe.py \
  2>&1 | tee $OUT/probe12/probe12.txt
OUT=$OUT/probe12_r16 RANK=16 PROBE=12 PYTHONPATH=/tmp/colora-shim timeout 240 python3 -P reports/h200/seventeenth/r64_probe.py \
  2>&1 | tee $OUT/probe12_r16/probe12_r16.txt

# 2. probe13_trainer/, probe13_packed24k/, probe13/ (at 2ba6981): every expand route named, rank 16: the
#    trainer's calls at 8 x 6,144 tokens and at 8 x 24k, then the five single shapes at 8 x 24k
export PYTHONPATH=/tmp/colora-shim RANK=16 PROBE=13
OUT=$OUT/probe13_trainer PACKED=1 BASE=1 TPJ=6144 timeout 150 python3 -P reports/h200/seventeenth/r64_probe.py
OUT=$OUT/probe13_packed24k PACKED=1 BASE=1 timeout 200 python3 -P reports/h200/seventeenth/r64_probe.py
OUT=$OUT/probe13 timeout 220 python3 -P reports/h200/seventeenth/r64_probe.py
#    (each piped through grep -v Warn into its folder's .txt)

# 3. probe14_trainer/, trainer_ab_81f452a/ (at 81f452a; .ab/base = git archive 3693ae4, the session's start,
#    carried): the op's base projection added after the LoRA delta by cuBLAS's epilogue (beta = 1) against
#    before it, the trainer's calls in one process; then the trainer step, each tree in its own process
OUT=$OUT/probe14_trainer RANK=16 PROBE=14 PACKED=1 BASE=1 TPJ=6144 PYTHONPATH=/tmp/colora-shim timeout 120 \
  python3 -P reports/h200/seventeenth/r64_probe.py
OUT=/tmp/ab/base timeout 170 bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new timeout 170 bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5

# 4. probe15_trainer/, probe15/ (at 295d578, the backward's base products after the LoRA's dx on every
#    route): the separate expands of y and dx by lora_expand_rows ("rows") against the one-tile-a-program
#    lora_expand of then ("tiles"): the trainer's calls, and o and down alone at 8 x 24k
OUT=$OUT/probe15_trainer RANK=16 PROBE=15 PACKED=1 BASE=1 TPJ=6144 PYTHONPATH=/tmp/colora-shim timeout 120 \
  python3 -P reports/h200/seventeenth/r64_probe.py
OUT=$OUT/probe15 RANK=16 PROBE=15 SHAPES=o,down PYTHONPATH=/tmp/colora-shim timeout 150 \
  python3 -P reports/h200/seventeenth/r64_probe.py

# 5. trainer_ab_call5/, kernels_lora_final/, tests_final/ (at 92ac45f, the final kernel code: lora_expand on
#    long programs, the old expand kernel removed): the trainer step against 3693ae4 (carried), the LoRA
#    table, the GPU tests (185 + 2 passed, 1 skipped: the vLLM-LoRA tuning test, no kit on the host)
OUT=/tmp/ab/base timeout 150 bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new timeout 150 bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
COLORA_TIMEOUT=150 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora
OUT=$OUT/tests timeout 200 bash scripts/h200.sh tests

# 6. trainer_ab_call6/ (at a925f31: 92ac45f's code, docstrings changed): the trainer step again, base
#    (3693ae4, carried) and new alternating, twice each, to size the run-to-run spread
for i in 1 2; do
  OUT=/tmp/ab/base$i timeout 130 bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
  OUT=/tmp/ab/new$i timeout 130 bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
done

# 7. tests_tidy/ (at 787093e, the final code: the sgrad kernel's launchers share _rows_config, lora_sgrad's
#    expand without its accumulate flag, a bad-input test): the GPU tests (186 + 2 passed, 1 skipped: the
#    vLLM-LoRA tuning test, no kit on the host)
OUT=$OUT/tests_tidy timeout 280 bash scripts/h200.sh tests
