# 2. probe8/, probe8_r16/, kernels_lora/ (at 562e7d4): the vectorised atomic partials against the dy read
#    twice and the per-tile partials, ranks 64 and 16, every shape; then the LoRA table of this tree
COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help > /dev/null 2>&1
mkdir -p $OUT/probe8 $OUT/probe8_r16
OUT=$OUT/probe8 PROBE=8 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P reports/h200/sixteenth/r64_probe.py 2>&1 | grep -v Warn | tee $OUT/probe8.txt
OUT=$OUT/probe8_r16 RANK=16 PROBE=8 PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P reports/h200/sixteenth/r64_probe.py 2>&1 | grep -v Warn | tee $OUT/probe8_r16.txt
COLORA_TIMEOUT=170 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora > /dev/null 2>&1; tail -3 $OUT/cli.log
