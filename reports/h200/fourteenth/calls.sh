# The fourteenth session's device calls, in order (one H200; the vLLM kit was not installed: the
# kernels and the trainer need none). Each call's files are in the folder named beside it.
# .ab/base: `git archive ce8abe6` (the tree the session started from), carried with the call.

# 1. kernels_tune/: the LoRA table with its kernel-by-kernel rows, then the launch-parameter search
#    (kernels/tune.py) at ce8abe6: no candidate gained more than 1.5%
COLORA_TIMEOUT=570 bash scripts/h200.sh cli bench kernels --only lora --only tune --tune-budget 400 --out $OUT/kernels_tune

# 2. fused_expand/: an uncommitted tree, 11308c1 without its blocked partials (fused expands, the
#    partials still in rows), with a 'separate expands' column measured in the same process; then the
#    GPU tests (1 failed: a CPU-table test asserting no graph timing; fixed in 11308c1 and c8c1e29)
COLORA_TIMEOUT=300 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora; bash scripts/h200.sh tests

# 3. (no folder: .ab/base was not carried, so the base half did not run; the new half, 11308c1 with
#    the blocked partials, showed the reduce 4x slower at k/v and q: 134 / 177 us, which call 4 explains)

# 4. reduce_probe.txt, blocked_rows_split/: the reduce alone in both layouts and several launch
#    shapes, then the LoRA table with a first split over rank rows (an uncommitted tree: rows split
#    only until two programs per SM; 906e0ac takes 4 rank rows always, from the probe)
PYTHONPATH=/tmp/colora-shim python3 reports/h200/fourteenth/reduce_probe.py
COLORA_TIMEOUT=200 bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_lora

# 5. final_ab/: ce8abe6 against 906e0ac, the LoRA table then the trainer step, each tree in its own
#    process, then the GPU tests at 906e0ac (final_ab/new/tests.log)
OUT=/tmp/ab/base bash .ab/base/scripts/h200.sh cli bench kernels --only lora --out /tmp/ab/base/kernels_lora
OUT=/tmp/ab/new bash scripts/h200.sh cli bench kernels --only lora --out /tmp/ab/new/kernels_lora
OUT=/tmp/ab/base bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new timeout 200 bash scripts/h200.sh tests

# 6. trainer_ab/: ce8abe6 against c8c1e29 (expands fused where d_in <= d_out), the trainer step, then
#    the GPU tests of c8c1e29's kernels (trainer_ab/new/tests.log: 168 + 2 passed, 1 skipped)
OUT=/tmp/ab/base bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5 --profile
OUT=/tmp/ab/new timeout 150 bash scripts/h200.sh tests
