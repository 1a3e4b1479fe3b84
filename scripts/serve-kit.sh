#!/bin/bash
# Downloads the wheels that `colora serve` and the official Tinker SDK's clients (`colora bench serve`) need on the
# benchmark GPU host beyond the vLLM kit (scripts/build-gpu-kit.sh), into OUT (default ./.serve, git-ignored; nine
# wheels, about 12 MB).
#
# usage: bash scripts/serve-kit.sh [OUT]
#
# What the host lacks: tinker 0.38.0 needs anyio, click, distro, httpx[http2], numpy, orjson, protobuf, pydantic,
# pyqwest, rich, sniffio, transformers, typing-extensions and zstandard; the host and the vLLM kit hold all but
# orjson, pyqwest (which needs opentelemetry-api), zstandard and httpx's http2 part (h2, hpack, hyperframe). The
# server runs under uvicorn (the vLLM kit's fastapi serves its routes). Each wheel's Requires-Dist is printed below.
#
# On the host, after the vLLM kit, with OUT carried (the device tool's carry: [".serve"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-serve .serve/*.whl
#   export PYTHONPATH=/tmp/colora-serve:/tmp/colora-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
# (`bash scripts/h200.sh serve ARGS...` does both, then runs `colora bench serve ARGS...`.)
set -euo pipefail
OUT=${1:-.serve}
PINS="tinker==0.38.0 pyqwest==0.12.0 opentelemetry-api==1.45.3 orjson==3.13.0 zstandard==0.25.0 uvicorn==0.55.0
h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0"
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
[ "$kb" -lt 61440 ] || { echo "serve kit: $OUT holds ${kb} KB, over the 60 MB a transfer carries" >&2; exit 1; }
echo "serve kit: $(ls "$OUT"/*.whl | wc -l) wheels, ${kb} KB in $OUT"
echo "on the host: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/colora-serve $OUT/*.whl"
echo "             export PYTHONPATH=/tmp/colora-serve:/tmp/colora-site:\$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0"
