set -x
COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
(OUT=$OUT/probe7 mkdir -p $OUT/probe7; OUT=$OUT/probe7 PROBE=7 PYTHONPATH=/tmp/colora-shim timeout 260 python3 -P reports/h200/sixteenth/r64_probe.py) 2>&1 | tee $OUT/probe7.txt | grep -v Warn
(mkdir -p $OUT/probe7_r16; OUT=$OUT/probe7_r16 RANK=16 SHAPES=k/v,gate/up PROBE=7 PYTHONPATH=/tmp/colora-shim timeout 90 python3 -P reports/h200/sixteenth/r64_probe.py) 2>&1 | tee $OUT/probe7_r16.txt | grep -v Warn
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
mkdir -p $OUT/ncu
SHAPES=k/v,gate/up NCU=1 PYTHONPATH=/tmp/colora-shim timeout 150 $NCU --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section LaunchStats python3 -P reports/h200/sixteenth/r64_probe.py > $OUT/ncu/r64.txt 2>&1; echo "ncu rc $?"; tail -5 $OUT/ncu/r64.txt
