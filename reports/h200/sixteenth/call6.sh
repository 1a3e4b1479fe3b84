# 6. probe10/, probe10_r16/, kernels_lora_final/, tests/ (at e7c2012, the final kernel code): the dy pass's dx
#    expand columns at rank 64 (128, the new choice, against 32 and 64), the forward shrink's stages at
#    rank 16 (information: not changed), the LoRA table, and the GPU tests
COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help > /dev/null 2>&1
mkdir -p $OUT/probe10 $OUT/probe10_r16
OUT=$OUT/probe10 SHAPES=q,k/v,gate/up PROBE=10 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/sixteenth/r64_probe.py 2>&1 | grep -v Warn | tee $OUT/probe10.txt
OUT=$OUT/probe10_r16 RANK=16 PROBE=10 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/sixteenth/r64_probe.py 2>&1 | grep -v Warn | tee $OUT/probe10_r16.txt
COLORA_TIMEOUT=150 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora > /dev/null 2>&1; grep "x_bound_graph" $OUT/kernels_lora.md
OUT=$OUT/tests timeout 170 bash scripts/h200.sh tests > /dev/null 2>&1; grep -h "passed\|failed" $OUT/tests/tests.log
