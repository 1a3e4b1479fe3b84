#!/usr/bin/env bash
# The twelfth session's device calls, in order (one H200; each through the device tool from the
# repository root; the machine went cold between some of them, so the kit or the shim was set up again).
# Outputs: the folder named beside each call.

# 1. kit part 1 (carry .gpu/p1)
bash .gpu/p1/install.sh
# 2. tests/: kit part 2 (carry .gpu/p2), the GPU tests at 07d6d64 (last session's bf16 compute copies, on by default)
bash .gpu/p2/install.sh; bash scripts/h200.sh tests
# 3. trainer_32k/: the trainer step at the benchmark's default micro-batch (32,768 tokens: 7 micro-batches)
bash scripts/h200.sh trainer --impls triton+packed+fused triton+packed+fused+kernels --peft-micro-seqs 32 --profile
# (cold machine) kit part 1 again; the trainer calls below need no vLLM, so part 2 was not installed
# 4. mb49152/, mb65536/: the experiments' micro-batch (4 micro-batches), with shapes per op; then 65,536
bash scripts/h200.sh trainer --impls triton+packed+fused --micro-batch-tokens 49152 --profile --profile-sources
OUT=$OUT/mb65536 bash scripts/h200.sh trainer --impls triton+packed+fused --micro-batch-tokens 65536
# (cold machine) kit part 1 again
# 5. gqa_probe.txt, then sources/ (the first sources run failed on a stale rollout version: fixed in c0da102)
python3 reports/h200/twelfth/gqa_probe.py
bash scripts/h200.sh trainer --impls triton+packed+fused --micro-batch-tokens 49152 --repeats 1 --profile-sources
# 6. ab_failed/: the GPU tests and A/B at 1532340 (carry .ab/base = git archive 07d6d64): torch's fused
#    AdamW refused B's transposed gradients (fixed in d44ff43)
# 7. ab/: the same at d44ff43, base and new in one call (shim: colora/, kernels/, tasks/ linked as in h200.sh)
PYTHONPATH=/tmp/colora-shim python3 -P -m pytest -q -m gpu tests/test_trainer.py tests/test_lora.py -p no:cacheprovider
OUT=$OUT/base bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused --micro-batch-tokens 49152 --profile
OUT=$OUT/new bash scripts/h200.sh trainer --impls triton+packed+fused --micro-batch-tokens 49152 --profile
# 8. new_profile/: the new tree's profile again (call 7's did not come back)
bash scripts/h200.sh trainer --impls triton+packed+fused --micro-batch-tokens 49152 --repeats 1 --profile
# 9. kernels_ab/: at fd87e62, the elementwise kernels' tests, then the step with and without the kernels
PYTHONPATH=/tmp/colora-shim python3 -P -m pytest -q tests/test_kernels.py -k "rotary or rms_norm or swiglu" -p no:cacheprovider
bash scripts/h200.sh trainer --impls triton+packed+fused triton+packed+fused+kernels --micro-batch-tokens 49152 --repeats 3
# 10. the GPU tests of the trainer and the adapters again with COLORA_ELEMENTWISE_KERNELS=1: 7 passed, but
#     those tests build no fused model, so they did not exercise the kernels (output not kept)
