# The nineteenth session's device calls, in order (one H200; Triton 3.6.0). Every probe call first made the shim:
#   COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help > /dev/null 2>&1
# Trees: the commit named, plus the uncommitted edits said.

# 1. ws16/ (at 8c1ce10 + ws_probe.py, committed in 6986a1e): Triton's Hopper GEMM on TMA descriptors, persistent,
#    with and without automatic warp specialisation (tl.range(warp_specialize=True); Hopper's pass wants 4 warps and
#    no flattened loop), x W^T alone and with the LoRA's expand in its epilogue, against cuBLAS and the op's
#    expand + cuBLAS, the trainer's slices (8 x 6,144 tokens, rank 16)
mkdir -p $OUT/ws16 && OUT=$OUT/ws16 PYTHONPATH=/tmp/colora-shim timeout 480 python3 -P \
  reports/h200/nineteenth/ws_probe.py \
  2>&1 | grep -v Warning | tee $OUT/ws16/ws_probe.txt

# 2-3. arms19s2/ (at 6986a1e): kit part 1 (carry .gpu/p1), then on the warm machine part 2 (carry .gpu/p2) and the
#    arms with today's trainer, seed 2. reports/ was moved out of the working tree for calls 2-4 (the tree and a kit
#    part together exceed the 64 MiB a call carries). runs/ = /tmp/colora-runs/arms19s2 (runs.tgz).
bash .gpu/p1/install.sh
bash .gpu/p2/install.sh && export PYTHONPATH=/tmp/colora-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 && \
  ARMS_NAME=arms19s2 bash scripts/h200.sh arms experiments/reference8_throughput.toml --arms dedicated overlap_mps \
  --seeds 2 --dedicated-steps 4 --deadline 540 --runs /tmp/colora-runs/arms19s2

# 4. arms19s3/ (same tree, the kit still installed on the warm machine): seed 3. Its runs.tgz held seed 2's run
#    directories too (the same /tmp/colora-runs); only arms19s3's are kept under arms19s3/runs.
export PYTHONPATH=/tmp/colora-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 && \
  ARMS_NAME=arms19s3 bash scripts/h200.sh arms experiments/reference8_throughput.toml --arms dedicated overlap_mps \
  --seeds 3 --dedicated-steps 4 --deadline 540 --runs /tmp/colora-runs/arms19s3

# arms_seeds123.{md,json,png}: here on the CPU, the three seeds' run directories (seed 1 from the eighteenth
# session's arms18 at 13136d7, whose trainer defaults are today's; seeds 2-3 from calls 3-4) in one folder, then the
# benchmark's own report from them:
#   mkdir -p /tmp/combined/{dedicated,overlap_mps}
#   for a in dedicated overlap_mps; do
#     cp -r reports/h200/eighteenth/arms18/runs/colora-runs/arms18/$a/seed1-main /tmp/combined/$a/
#     cp -r reports/h200/nineteenth/arms19s2/runs/colora-runs/arms19s2/$a/seed2-main /tmp/combined/$a/
#     cp -r reports/h200/nineteenth/arms19s3/runs/colora-runs/arms19s3/$a/seed3-main /tmp/combined/$a/
#   done
#   colora bench arms experiments/reference8_throughput.toml --arms dedicated overlap_mps --seeds 1 2 3 \
#     --dedicated-steps 4 --report-only --runs /tmp/combined --out /tmp/arms_seeds123   (copied here)

# 5. wsfwd/, ws16b/ (at 47566bb): the rank-64
#    forward (x -> h -> y) as a persistent descriptor kernel, with and without warp specialisation, against
#    lora_shrink_expand -- whose baseline here passed B row-major, the expand's weight read across its rows, which
#    the op never does (call 7 repeats it with the op's layout); and ws_probe's warp-specialised fused variants
#    again, counting the rows they left not finite
mkdir -p $OUT/wsfwd $OUT/ws16b
OUT=$OUT/wsfwd PYTHONPATH=/tmp/colora-shim timeout 300 python3 -P reports/h200/nineteenth/ws_fwd_probe.py 2>&1 | \
  grep -v Warning | tee $OUT/wsfwd/ws_fwd_probe.txt
OUT=$OUT/ws16b CONFIGS=3,4 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/nineteenth/ws_probe.py \
  2>&1 | grep -v Warning | tee $OUT/ws16b/ws_probe.txt

# 6. p18/ (at 9856d27: lora_shrink_expand_persistent_kernel, the weight tile always zeroed past r_j): the persistent
#    tests on the GPU (16 passed), then the op's forward + backward with the persistent launch (descriptors for x and
#    the weights, x alone, pointers, 128 expand columns, 2 programs an SM) against the own, ranks 64 and 16
mkdir -p $OUT/p18_r64 $OUT/p18_r16 $OUT/tests
COLORA_KERNEL_TEST_LOG=$OUT/tests/kernel_tests.jsonl PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P -m pytest -q \
  tests/test_kernels_gpu.py tests/test_kernels.py -k "persistent" -p no:cacheprovider 2>&1 | tail -5 | \
  tee $OUT/tests/tests.txt
OUT=$OUT/p18_r64 PROBE=18 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P reports/h200/seventeenth/r64_probe.py \
  2>&1 | grep -v -i warn | tee $OUT/p18_r64/probe18.txt
OUT=$OUT/p18_r16 RANK=16 PROBE=18 PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P \
  reports/h200/seventeenth/r64_probe.py 2>&1 | grep -v -i warn | tee $OUT/p18_r16/probe18.txt

# 7. wsfwd2/ (at 9856d27 + the probe's fair baseline, committed in 24f3a54): the forward probe with the own launch
#    given B as the op gives it (B^T's transpose view), the op's persistent launch, and the descriptor kernel
mkdir -p $OUT/wsfwd2 && OUT=$OUT/wsfwd2 CONFIGS=0,2 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P \
  reports/h200/nineteenth/ws_fwd_probe.py 2>&1 | grep -v Warning | tee $OUT/wsfwd2/ws_fwd_probe.txt

# 8. p19/ (at 24f3a54: EVEN_R, no zeroing of the expand's weight tile where every rank is BLOCK_R): the persistent
#    tests (16 passed, tests_persistent.txt), then PROBE=19 (own / persistent desc, each twice), ranks 64 and 16
PYTHONPATH=/tmp/colora-shim timeout 100 python3 -P -m pytest -q tests/test_kernels_gpu.py tests/test_kernels.py \
  -k "persistent" -p no:cacheprovider 2>&1 | tail -3
OUT=$OUT/p19_r64 PROBE=19 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/seventeenth/r64_probe.py \
  2>&1 | grep -v -i warn | tee $OUT/p19_r64/probe19.txt
OUT=$OUT/p19_r16 RANK=16 PROBE=19 PYTHONPATH=/tmp/colora-shim timeout 100 python3 -P \
  reports/h200/seventeenth/r64_probe.py 2>&1 | grep -v -i warn | tee $OUT/p19_r16/probe19.txt

# 9-10. tests_final/ (at 24f3a54; the later commits change the persistent launch's fp32 choice, compile_check, tests
#    and documents, not a default path): the kernels' GPU tests (36 passed) and the trainer's (26 passed)
COLORA_KERNEL_TEST_LOG=$OUT/tests_gpu/kernel_tests.jsonl PYTHONPATH=/tmp/colora-shim timeout 140 python3 -P -m pytest \
  -q tests/test_kernels_gpu.py -p no:cacheprovider -x 2>&1 | tail -4
PYTHONPATH=/tmp/colora-shim timeout 130 python3 -P -m pytest -q tests/test_trainer.py \
  -k "gpu or triton or not interpreter" \
  -p no:cacheprovider 2>&1 | tail -4
