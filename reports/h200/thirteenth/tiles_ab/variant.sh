# variant NAME PYTHON-PATCH: the trainer benchmark with a patch applied before it runs
export PYTHONPATH=/tmp/colora-shim:$PYTHONPATH COLORA_HOME=/tmp/colora-home PYTHONUNBUFFERED=1
v() { mkdir -p $OUT/$1; python3 -P -c "import colora.kernels.lora as L, colora.kernels.lora_ops as O; $2
from colora.bench_trainer import main; main(['--impls', 'triton+packed+fused+kernels+base', '--profile', '--out', '$OUT/$1/trainer_step'])" > $OUT/$1/trainer.log 2>&1; grep -h '^{' $OUT/$1/trainer.log | cut -c1-330; }
