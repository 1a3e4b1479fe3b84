# The fifteenth session's device calls, in order (one H200, no vLLM kit: the kernels need none). Each
# call's files are in the folder named beside it. r64_probe.py's PROBE picks the call's variant set.
# .ab/base: `git archive 0c409b1` (the tree the session started from), carried with calls 2 and 3.

# 1. probe1/, tune/ (at 0c409b1): rank 64, 8 jobs x 24k tokens, each shape in one process: tile and
#    fusion variants beside the launchers' own choice and beside cuBLAS doing the same six products
#    on the same rows as one adapter; then the launch-parameter search over the rank-64 problems
COLORA_TIMEOUT=5 bash scripts/h200.sh cli --help   # (makes the shim)
OUT=$OUT/probe1 PROBE=1 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py
COLORA_TIMEOUT=240 bash scripts/h200.sh cli bench kernels --only tune --tune-budget 200 --out $OUT/kernels_tune

# 2. probe2/, launch_ab/: a tree with the search's rank-64 launch choices (64aa18a without its
#    fuse_expand_pays change), the probe's variants around them (and 0c409b1's choices as overrides in
#    the same process), then the LoRA table of 0c409b1 and of that tree, each in its own process
OUT=$OUT/probe2 PROBE=2 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py
OUT=/tmp/ab/base COLORA_TIMEOUT=150 bash .ab/base/scripts/h200.sh cli bench kernels --only lora --out /tmp/ab/base/kernels_lora
OUT=/tmp/ab/new COLORA_TIMEOUT=150 bash scripts/h200.sh cli bench kernels --only lora --out /tmp/ab/new/kernels_lora

# 3. final_ab/, probe3/: 0c409b1 against 64aa18a (the expands fused at every rank-64 shape too), the
#    LoRA table of each; the probe's final rows beside cuBLAS; the GPU tests at 64aa18a
#    (final_ab/new/tests.log: 168 + 2 passed, 1 skipped: the vLLM-LoRA test, no kit on the host)
OUT=/tmp/ab/base COLORA_TIMEOUT=150 bash .ab/base/scripts/h200.sh cli bench kernels --only lora --out /tmp/ab/base/kernels_lora
OUT=/tmp/ab/new COLORA_TIMEOUT=150 bash scripts/h200.sh cli bench kernels --only lora --out /tmp/ab/new/kernels_lora
OUT=$OUT/probe3 PROBE=3 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py
OUT=/tmp/ab/new timeout 200 bash scripts/h200.sh tests

# 4. probe4/ (at 64aa18a): the shrink's and the sgrad's shared memory a program (BLOCK_K 32 / 64 x 3-6
#    stages; sgrad row and column tiles): none faster than the launchers' own choice
OUT=$OUT/probe4 PROBE=4 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py

# 5. kernels_lora/ (at 5c4381c): the LoRA table with the cuBLAS ceiling in its kernel-by-kernel rows
#    (bench.dense_lora_products beside every 8 x 24k row, all ranks)
COLORA_TIMEOUT=200 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora

# 6. tests/ (at 07f6a4d, the final code): the GPU tests (169 + 2 passed, 1 skipped: no kit on the host)
timeout 250 bash scripts/h200.sh tests

# 7. probe5/, probe5_r16/ (at a3e44e0, the chunked dy pass, reverted in b0b794f): the dy pass keeping
#    one dB partial per chunk of row tiles against the launchers' own choice and the per-tile fused
#    dy pass: slower at every shape, rank 64 and rank 16
OUT=$OUT/probe5 PROBE=5 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py
OUT=$OUT/probe5_r16 RANK=16 SHAPES=k/v,gate/up PROBE=5 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py

# 8. probe6/, probe6_r16/ (at 7bf6061, evict-first on x and y, reverted in 432c9e5): each variant twice
OUT=$OUT/probe6 PROBE=6 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py
OUT=$OUT/probe6_r16 RANK=16 SHAPES=q,k/v,gate/up PROBE=6 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/fifteenth/r64_probe.py
