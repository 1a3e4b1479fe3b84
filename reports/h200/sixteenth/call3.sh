# 3. trainer_ab/ (a099bda, the session's start, in .ab/base, against 562e7d4): the trainer step (8 jobs x
#    64 sequences x 384 tokens, rank 16, the default impl), each tree in its own process, 5 steps; then
#    the GPU tests at 562e7d4 (trainer_ab/new/tests.log)
OUT=/tmp/ab/base timeout 200 bash .ab/base/scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5
OUT=/tmp/ab/new timeout 200 bash scripts/h200.sh trainer --impls triton+packed+fused+kernels+base --repeats 5 --profile
OUT=/tmp/ab/new timeout 170 bash scripts/h200.sh tests
cd /tmp && tar czf $OUT/trainer_ab.tgz ab; grep -h "step\|passed\|failed" /tmp/ab/*/trainer.log /tmp/ab/new/tests.log | tail -12
