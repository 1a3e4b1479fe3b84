# The twentieth session's device calls, in order (one H200; Triton 3.6.0). Every call first made the shim:
#   COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help > /dev/null 2>&1
# Trees: the commit named, plus the uncommitted edits said. stream_probe.py's "own" / "tiles" rows are the launches
# of one program a tile (lora_shrink_kernel); "stream" rows lora_stream_kernel.

# 1. s1/ (at 364419f + lora_stream_kernel, its launcher off by default, the first stream_probe.py; committed in
#    8e23cbf with the defaults this call chose): rank 64, every section; rank 16, forward and step
OUT=$OUT/s1_r64 PYTHONPATH=/tmp/colora-shim timeout 420 python3 -P reports/h200/twentieth/stream_probe.py
OUT=$OUT/s1_r16 RANK=16 PARTS=fwd,step PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P \
  reports/h200/twentieth/stream_probe.py

# 2. s2/ (at 8e23cbf: the stream launches the default at BLOCK_R 64, the probe's variants renamed): the stream tests
#    on the GPU (tests/: 6 failed, all on the tests' own assertion that the dy pass takes the stream launch, which
#    their batches were too small for on 132 SMs; fixed in the next tree), rank 64 every section (s2_r64: an
#    illegal memory access between the first and second shape, see call 7), the step at the trainer's 8 x 6,144
#    tokens (s2_r64_6k) and at rank 16 (s2_r16)
COLORA_KERNEL_TEST_LOG=$OUT/tests/kernel_tests.jsonl PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P -m pytest \
  -q tests/test_kernels_gpu.py tests/test_kernels.py -k "stream or full_tiles or fuses_where" -p no:cacheprovider
OUT=$OUT/s2_r64 PYTHONPATH=/tmp/colora-shim timeout 300 python3 -P reports/h200/twentieth/stream_probe.py
OUT=$OUT/s2_r64_6k TPJ=6144 PARTS=step PYTHONPATH=/tmp/colora-shim timeout 60 python3 -P \
  reports/h200/twentieth/stream_probe.py
OUT=$OUT/s2_r16 RANK=16 PARTS=step PYTHONPATH=/tmp/colora-shim timeout 60 python3 -P \
  reports/h200/twentieth/stream_probe.py

# 3. s3/ (8e23cbf + the tests' batch sizes, committed in 4f4297c, and a synchronisation after each probe variant;
#    the probe's later switches, calls 5 and 7, are committed with these reports in 6c75111): the kernels' GPU tests and
#    the stream / tile-split tests (48 passed, tests/kernel_tests.jsonl), then q and k/v with CUDA_LAUNCH_BLOCKING=1
#    (no fault; its calibrated copy rate, 3928 GB/s, is low: read its "x bound" with care, its "x own" is sound)
COLORA_KERNEL_TEST_LOG=$OUT/tests/kernel_tests.jsonl PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P -m pytest \
  -q tests/test_kernels_gpu.py tests/test_kernels.py -k "gpu or stream or full_tiles or fuses_where" -p no:cacheprovider
OUT=$OUT/s3 CUDA_LAUNCH_BLOCKING=1 SHAPES=q,k/v PYTHONPATH=/tmp/colora-shim timeout 300 python3 -P \
  reports/h200/twentieth/stream_probe.py

# 4. s4/ (same tree): rank 64 every section (faulted between the second and third shape), then the trainer's GPU
#    tests (26 passed, tests/trainer_tests.txt)
OUT=$OUT/s4 PYTHONPATH=/tmp/colora-shim timeout 330 python3 -P reports/h200/twentieth/stream_probe.py
PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P -m pytest -q tests/test_trainer.py -k "gpu or triton or not interpreter" \
  -p no:cacheprovider

# 5. d5/ (same tree + the probe's STREAM_OFF / NO_DENSE switches): the step section alone at every shape, one
#    process each: dA as by default (the session's step figures), dB with the stream launches off, dC without the
#    cuBLAS rows; none faulted
OUT=$OUT/dA PARTS=step PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P reports/h200/twentieth/stream_probe.py
OUT=$OUT/dB STREAM_OFF=1 PARTS=step PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P \
  reports/h200/twentieth/stream_probe.py
OUT=$OUT/dC NO_DENSE=1 PARTS=step PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P \
  reports/h200/twentieth/stream_probe.py

# 6. f6/ (same tree + fault_probe.py): every stream configuration of calls 2 and 4 (suspects) and the defaults, each
#    eagerly, as a CUDA graph and under the profiler, then cuBLAS, at every shape twice: no fault in 20 transitions
SET=suspects ROUNDS=2 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P reports/h200/twentieth/fault_probe.py
SET=defaults ROUNDS=2 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P reports/h200/twentieth/fault_probe.py

# 7. c7/ (same tree + the probe's TILES_ONLY switch): the full probe with no stream launch at all (c1: the control)
#    and as by default (c2). Both faulted between the first and second shape: the fault is not lora_stream_kernel's
OUT=$OUT/c1 STREAM_OFF=1 TILES_ONLY=1 PYTHONPATH=/tmp/colora-shim timeout 200 python3 -P \
  reports/h200/twentieth/stream_probe.py
OUT=$OUT/c2 PYTHONPATH=/tmp/colora-shim timeout 260 python3 -P reports/h200/twentieth/stream_probe.py

# 8. s8/ (same tree): o, gate/up and down every section, one process a shape (no fault)
for s in o gate/up down; do d=$OUT/s5_$(echo $s | tr / _); mkdir -p $d
  OUT=$d SHAPES=$s PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P reports/h200/twentieth/stream_probe.py; done

# 9. final/ (at 6c75111: the persistent kernel removed, the documents): the kernels' GPU tests with the stream /
#    tile-split tests (43 passed: 48 less the five persistent ones removed; kernel_tests.jsonl) and the trainer's
#    (26 passed)
COLORA_KERNEL_TEST_LOG=$OUT/final/kernel_tests.jsonl PYTHONPATH=/tmp/colora-shim timeout 170 python3 -P -m pytest \
  -q tests/test_kernels_gpu.py tests/test_kernels.py -k "gpu or stream or full_tiles or fuses_where" -p no:cacheprovider
PYTHONPATH=/tmp/colora-shim timeout 150 python3 -P -m pytest -q tests/test_trainer.py -k "gpu or triton or not interpreter" \
  -p no:cacheprovider

# 10. e10/ (at 32509fc): the control narrowed: the forward and dy sections alone with no stream launch (e1: faulted
#     between the second and third shape) and the whole control without torch.cuda.empty_cache (e2, FRESH=1:
#     faulted between the first and second): neither the cuBLAS rows nor empty_cache nor the stream kernel
OUT=$OUT/e1 STREAM_OFF=1 TILES_ONLY=1 PARTS=fwd,dy PYTHONPATH=/tmp/colora-shim timeout 100 python3 -P \
  reports/h200/twentieth/stream_probe.py
OUT=$OUT/e2 FRESH=1 STREAM_OFF=1 TILES_ONLY=1 PYTHONPATH=/tmp/colora-shim timeout 120 python3 -P \
  reports/h200/twentieth/stream_probe.py

# 11. san/ (same tree): e1 under compute-sanitizer's memcheck (the host has it in /usr/local/cuda/bin). Its first
#     report: lora_shrink_kernel reading the segment table at a job index read from the tile table, 4.5 GB past it,
#     in the first shape's first variant, inside triton.testing.do_bench_cudagraph. That timer runs fn on a stream
#     of its own, and the tile table fn's eager call had just uploaded (without blocking, on the default stream)
#     had not landed: the probe's race, not a kernel's. Fixed after this call: stream_probe.py's graph_us and
#     kernels/bench.py's _graph_timer synchronise before handing fn to that stream.
OUT=$OUT/san STREAM_OFF=1 TILES_ONLY=1 PARTS=fwd,dy SHAPES=q,k/v,o PYTHONPATH=/tmp/colora-shim timeout 140 \
  compute-sanitizer --tool memcheck --print-limit 3 --log-file $OUT/san/memcheck.log python3 -P \
  reports/h200/twentieth/stream_probe.py
