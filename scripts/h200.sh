#!/usr/bin/env bash
# colora's GPU work on the benchmark H200, run through the device tool after the vLLM kit is
# installed (docs/gpu-host.md). The host has its own torch/Triton/transformers/peft and no
# package index: colora is installed there editable from this checkout, without its dependencies
# (pip install --no-index --no-deps --no-build-isolation -e .; the host's pip 24 and setuptools 81
# do it), once per checkout. Everything lands in $OUT (what comes back).
#
#   bash scripts/h200.sh kernels            GPU kernel tests, kernel benchmark, trainer-step benchmark
#   bash scripts/h200.sh tests              the GPU tests of the kernels and the trainer
#   bash scripts/h200.sh trainer ARGS...    colora bench trainer ARGS... --out $OUT/trainer_step
#   bash scripts/h200.sh engine ARGS...     colora bench engine ARGS... --out $OUT/engine/report (step time by
#                                           batch and active adapters; with --profile the breakdown, with
#                                           --sample py-spy's, from the peer kit's wheel carried as .peer): a
#                                           report folder, report.md/.json/.png/.profile.txt/.sample.txt
#   bash scripts/h200.sh arms ARGS...       colora bench arms ARGS... (with a deadline; with --runs
#                                           /tmp/colora-runs the run directories come back as runs.tgz;
#                                           ARMS_NAME=NAME names the report, default arms; its JSON is
#                                           also kept in /tmp/colora-reports for a later call's trl --beside)
#   bash scripts/h200.sh smollm2            build builtin:smollm2 from the kit's GGUF (COLORA_KIT_SMOLLM2=1)
#   bash scripts/h200.sh trl ARGS...        colora bench trl ARGS... --out $OUT/trl/report (the peer baseline;
#                                           TRL's wheels from scripts/peer-kit.sh carried as .peer, installed once)
#   bash scripts/h200.sh serve ARGS...      colora bench serve ARGS... --out $OUT/serve (N Tinker SDK clients against
#                                           colora serve; the SDK's and the server's wheels from
#                                           scripts/serve-kit.sh carried as .serve, installed once)
#   bash scripts/h200.sh cli ARGS...        colora ARGS... (run, sweep, ...; the log is $OUT/cli.log;
#                                           COLORA_TIMEOUT=S stops it after S seconds)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
# /tmp/colora-ray: Ray, where scripts/ray-kit.sh installed it (cli run ... --gpus N / --address local)
export PYTHONPATH=/tmp/colora-site:/tmp/colora-ray:${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 COLORA_HOME=/tmp/colora-home
cd "$ROOT"
WHAT=$1
LOG="$OUT/$WHAT.log"
# colora from this checkout, importable from anywhere (python -P never looks in the working directory)
installed() {
  python3 -P -c "import colora, colora.kernels, colora.tasks, pathlib, sys
sys.exit(pathlib.Path(colora.__file__).resolve().parent != pathlib.Path('$ROOT/colora').resolve())" 2>/dev/null
}
if ! installed; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" >> "$LOG" 2>&1 ||
    python3 -m pip install -q --user --no-index --no-deps --no-build-isolation -e "$ROOT" >> "$LOG" 2>&1
  installed || { echo "colora: the editable install of $ROOT failed (see $LOG)" | tee -a "$LOG"; exit 2; }
fi
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -c "import sys, torch, triton, transformers, peft; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
} >> "$LOG" 2>&1
gpu_tests() {  # the GPU tests of the kernels and the trainer, within $1 seconds; then the other gpu-marked ones
  timeout "$1" python3 -P -m pytest -q tests/test_kernels_gpu.py tests/test_kernel_lora.py tests/test_kernel_lora_routes.py tests/test_kernel_logsoftmax.py tests/test_kernel_elementwise.py tests/test_trainer.py -k "gpu or triton or not interpreter" -p no:cacheprovider 2>&1 | tail -40 >> "$LOG"
  timeout 120 python3 -P -m pytest -q -m gpu tests/test_lora.py tests/test_trainer_gpu_memory.py -p no:cacheprovider 2>&1 | tail -20 >> "$LOG"
}
case "$1" in
  kernels)
    gpu_tests 170
    timeout 200 python3 -P -m colora.cli bench kernels --out "$OUT/kernels" >> "$LOG" 2>&1; echo "bench kernels: $?" >> "$LOG"
    timeout 170 python3 -P -m colora.cli bench trainer --peft-micro-seqs 32 --out "$OUT/trainer_step" >> "$LOG" 2>&1; echo "bench trainer: $?" >> "$LOG"
    ;;
  tests)
    gpu_tests 300
    ;;
  trainer)
    shift
    python3 -P -m colora.cli bench trainer "$@" --out "$OUT/trainer_step" >> "$LOG" 2>&1; echo "bench trainer: $?" >> "$LOG"
    ;;
  engine)
    shift
    spy=()
    if [[ " $* " == *" --sample "* ]]; then  # py-spy from the peer kit's wheels (.peer), installed once
      [ -x /tmp/colora-pyspy/bin/py-spy ] ||
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-pyspy "$ROOT"/.peer/py_spy-*.whl >> "$LOG" 2>&1 ||
        { echo "engine: py-spy's wheel (.peer, scripts/peer-kit.sh) did not install" | tee -a "$LOG"; exit 2; }
      spy=(--py-spy /tmp/colora-pyspy/bin/py-spy)
    fi
    python3 -P -m colora.cli bench engine "$@" "${spy[@]}" --out "$OUT/engine/report" >> "$LOG" 2>&1; echo "bench engine: $?" >> "$LOG"
    ;;
  arms)
    shift
    python3 -P -m colora.cli bench arms "$@" --out "$OUT/${ARMS_NAME:-arms}" >> "$LOG" 2>&1; echo "bench arms: $?" >> "$LOG"
    mkdir -p /tmp/colora-reports && cp "$OUT/${ARMS_NAME:-arms}.json" /tmp/colora-reports/ 2>/dev/null
    # the run directories (timelines, metrics, logs; not the adapters), when --runs /tmp/colora-runs
    [ -d /tmp/colora-runs ] && tar czf "$OUT/runs.tgz" --exclude=adapters --exclude=.adapters \
      --exclude=checkpoints -C /tmp colora-runs
    ;;
  smollm2)
    # The host reaches no index: the model is converted from the GGUF the kit carries.
    [ -f "$COLORA_HOME/models/smollm2/config.json" ] || \
      python3 -P -m colora.cli model smollm2 "$COLORA_HOME/models/smollm2" \
        --source /tmp/colora-site/colora-models/SmolLM2-135M-Instruct.Q4_1.gguf >> "$LOG" 2>&1
    echo "model smollm2: $?" >> "$LOG"
    ;;
  trl)
    shift
    if [ ! -f /tmp/colora-peer/.done ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-peer "$ROOT"/.peer/*.whl >> "$LOG" 2>&1 &&
        touch /tmp/colora-peer/.done || { echo "trl: the peer kit's wheels (.peer) did not install" | tee -a "$LOG"; exit 2; }
    fi
    export PYTHONPATH=/tmp/colora-peer:$PYTHONPATH
    python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" >> "$LOG" 2>&1
    python3 -m pip list 2>/dev/null | grep -i -E "^(pyarrow|pandas|fsspec|huggingface.hub|accelerate|peft|dill|multiprocess) " >> "$LOG"
    python3 -P -m colora.cli bench trl "$@" --out "$OUT/trl/report" >> "$LOG" 2>&1; echo "bench trl: $?" >> "$LOG"
    ;;
  serve)
    shift
    if [ ! -f /tmp/colora-serve/.done ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-serve "$ROOT"/.serve/*.whl >> "$LOG" 2>&1 &&
        touch /tmp/colora-serve/.done || { echo "serve: the serve kit's wheels (.serve) did not install" | tee -a "$LOG"; exit 2; }
    fi
    export PYTHONPATH=/tmp/colora-serve:$PYTHONPATH
    python3 -c "import tinker, uvicorn, fastapi; print('tinker', tinker.__version__, 'uvicorn', uvicorn.__version__, 'fastapi', fastapi.__version__)" >> "$LOG" 2>&1
    python3 -P -m colora.cli bench serve "$@" --out "$OUT/serve" >> "$LOG" 2>&1; echo "bench serve: $?" >> "$LOG"
    ;;
  cli)
    shift
    # COLORA_TIMEOUT=S stops the command (SIGTERM to python itself) after S seconds; 0: no limit.
    timeout "${COLORA_TIMEOUT:-0}" python3 -P -m colora.cli "$@" >> "$LOG" 2>&1; echo "colora $1: $?" >> "$LOG"
    ;;
esac
# What comes back is a few files at most (the device tool leaves the rest out): everything but the log in one
# archive, $OUT/out.tgz (tar xzf out.tgz there).
mapfile -t made < <(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name "$WHAT.log" ! -name out.tgz)
if [ ${#made[@]} -gt 0 ]; then
  tar czf /tmp/colora-out.tgz -C "$OUT" "${made[@]}" && (cd "$OUT" && rm -rf "${made[@]}") &&
    mv /tmp/colora-out.tgz "$OUT/out.tgz" || echo "h200.sh: could not pack $OUT into out.tgz" | tee -a "$LOG"
fi
grep -v -E "^\(|INFO|WARNING" "$LOG" | tail -60
