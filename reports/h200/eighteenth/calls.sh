# The eighteenth session's device calls, in order (one H200). r64_probe.py's PROBE picks the variant set (see
# its docstring); the shim first in every probe call: COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help

# 1. probe16/ (at 13136d7 + PROBE=16 added to reports/h200/seventeenth/r64_probe.py): rank 64, every shape, the
#    dy pass reading dy alone (dh and the atomic dB) with dx by lora_expand (long programs), against the own route
#    (dx expanded in the dy pass where dB fuses, in dh's pass elsewhere)
mkdir -p $OUT/probe16
OUT=$OUT/probe16 PROBE=16 PYTHONPATH=/tmp/colora-shim timeout 420 python3 -P reports/h200/seventeenth/r64_probe.py \
  2>&1 | grep -v -i warn | tee $OUT/probe16/probe16.txt

# 2-3. arms18/ (at 13136d7): kit part 1 (carry .gpu/p1), then on the warm machine part 2 (carry .gpu/p2) and the
#    arms with today's trainer, seed 1: dedicated (4 steps a job) and overlap_mps, one benchmark. reports/ was moved
#    out of the working tree for these two calls (the tree and a kit part together exceed the 64 MiB a call carries).
#    runs/ = /tmp/colora-runs/arms18 (runs.tgz, adapters and checkpoints excluded).
bash .gpu/p1/install.sh
bash .gpu/p2/install.sh && export PYTHONPATH=/tmp/colora-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 && \
  ARMS_NAME=arms18 bash scripts/h200.sh arms experiments/reference8_throughput.toml --arms dedicated overlap_mps \
  --seeds 1 --dedicated-steps 4 --deadline 540 --runs /tmp/colora-runs/arms18
