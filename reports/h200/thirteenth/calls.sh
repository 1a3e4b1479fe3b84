# The thirteenth session's device calls, in order (one H200; the vLLM kit was not installed: the
# trainer and the kernels need none). Each call's files are in the folder named beside it.
# R=$PWD; shim: mkdir -p /tmp/colora-shim/colora; ln -sfn the repository's colora/*, kernels, tasks into it

# 1. base_ab/: the base-in-LoRA tests on the GPU, then the A/B at 07f5023 (one process per impl)
PYTHONPATH=/tmp/colora-shim python3 -P -m pytest -q tests/test_kernels.py tests/test_trainer.py -k "base_weight_inside or base_inside"
bash scripts/h200.sh trainer --impls triton+packed+fused+kernels triton+packed+fused+kernels+base --profile

# 2. sources/: where the time goes, torch's stack grouping (07f5023)
bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --profile-sources

# 3. callers/: the same with ops grouped by caller, module instances merged (ef0ea34): found the KV cache
bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --profile-sources --repeats 1

# 4. cache_ab/: 07f5023 (.ab/base, git archive) against 394b14f (no KV cache; base-in-LoRA default)
OUT=$OUT/base bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base
OUT=$OUT/new bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base triton+packed+fused+kernels --profile

# 5. tiles_ab/: the fused dy pass's tiles at 394b14f + FUSED_TILE_WAVES, four processes in one call
#    (.ab/variant.sh: runs colora.bench_trainer.main after a patch; all_four.txt has every result line)
v fused64 "pass"; v unfused "L.fuse_dy_pays = lambda m: False"; v fused256 "O.FUSED_TILE_WAVES = 1"; v fused64_again "pass"

# 6. final/: the session's start (07f5023) against 857c862 and peft, then the GPU tests at 857c862
OUT=$OUT/base bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels
OUT=$OUT/final bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base peft --peft-micro-seqs 32 --profile
OUT=$OUT/final bash scripts/h200.sh tests

# 7. repeats/: two more processes of 857c862, 5 steps each
for i in 1 2; do OUT=$OUT/repeat$i bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5; done

# 8. kernels/: colora bench kernels at 857c862 (event timing only)
bash scripts/h200.sh cli bench kernels --out $OUT/kernels

# 9. kernels_graph/: the LoRA table with the CUDA-graph timing (322c388)
bash scripts/h200.sh cli bench kernels --only lora --out $OUT/kernels_graph
