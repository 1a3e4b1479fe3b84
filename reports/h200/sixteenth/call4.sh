# 4. probe9/, probe9_r16/ (at COMMIT): the shrink's x loads and its fused expand's y stores through TMA
#    (shrink "tma"), rank 64 every shape, rank 16 at q, o, gate/up
COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help > /dev/null 2>&1
mkdir -p $OUT/probe9 $OUT/probe9_r16
OUT=$OUT/probe9 PROBE=9 PYTHONPATH=/tmp/colora-shim timeout 240 python3 -P reports/h200/sixteenth/r64_probe.py 2>&1 | grep -v Warn | tee $OUT/probe9.txt
OUT=$OUT/probe9_r16 RANK=16 SHAPES=q,o,gate/up PROBE=9 PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P reports/h200/sixteenth/r64_probe.py 2>&1 | grep -v Warn | tee $OUT/probe9_r16.txt
