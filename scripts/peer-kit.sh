#!/bin/bash
# Downloads the wheels that the peer baseline (`colora bench trl`, TRL's GRPOTrainer) and the engine's
# sampling profile (`colora bench engine --sample`: py-spy, a static binary in a wheel) need on the
# benchmark GPU host and that the host lacks, into OUT (default ./.peer, git-ignored; four wheels, 4.5 MB).
#
# usage: bash scripts/peer-kit.sh [OUT]
#
# What the host lacks: each wheel's Requires-Dist (printed below) against the host's package list
# (the device notes' KINDS.md): trl needs accelerate, datasets, huggingface_hub, jinja2, numpy,
# packaging, pandas, psutil, pyarrow, pyyaml, transformers: all there but datasets; datasets needs
# filelock, numpy, pyarrow, dill, pandas, requests, httpx, tqdm, xxhash, multiprocess, fsspec,
# huggingface-hub, packaging, pyyaml: all there but multiprocess and dill, and dill 0.4.1 comes with
# colora's vLLM kit (/tmp/colora-site, scripts/build-gpu-kit.sh). datasets 4.8 rather than 5: 5.x
# asks for pyarrow>=24, 4.8 for pyarrow>=21 (the host's pyarrow version is not on record:
# `bash scripts/h200.sh trl` logs it).
#
# On the host, after the vLLM kit, with OUT carried (the device tool's carry: [".peer"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-peer .peer/*.whl
#   export PYTHONPATH=/tmp/colora-peer:/tmp/colora-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
# (`bash scripts/h200.sh trl ARGS...` does both, then runs `colora bench trl ARGS...`.)
set -euo pipefail
OUT=${1:-.peer}
PINS="trl==1.16.0 datasets==4.8.4 multiprocess==0.70.19 py-spy==0.4.3"
mkdir -p "$OUT"
for pin in $PINS; do
  name=${pin%%==*}; name=${name//-/_}; ver=${pin##*==}
  ls "$OUT"/${name}-${ver}-*.whl >/dev/null 2>&1 && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 \
    --platform any -d "$OUT" "$pin"
done
for w in "$OUT"/*.whl; do
  echo "$(basename "$w"): $(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' |
    sed 's/^Requires-Dist: //' | paste -sd';' | sed 's/;/; /g')"
done
kb=$(du -sk "$OUT" | cut -f1)
[ "$kb" -lt 61440 ] || { echo "peer kit: $OUT holds ${kb} KB, over the 60 MB a transfer carries" >&2; exit 1; }
echo "peer kit: $(ls "$OUT"/*.whl | wc -l) wheels, ${kb} KB in $OUT"
echo "on the host: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-peer $OUT/*.whl"
echo "             export PYTHONPATH=/tmp/colora-peer:/tmp/colora-site:\$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0"
