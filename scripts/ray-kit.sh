#!/usr/bin/env bash
# Ray for the benchmark GPU host, which reaches no package index: the ray 2.60.0 wheel (cp312,
# manylinux2014, about 79 MB) split into parts of at most 45 MiB, one folder per part (a transfer to
# the host carries 64 MiB, the working tree included). The host already has Ray's dependencies
# (msgpack, protobuf, grpcio, aiohttp, PyYAML, filelock, click, requests, psutil; jsonschema comes
# with the vLLM kit, docs/gpu-host.md).
#
#   bash scripts/ray-kit.sh [OUT] [--wheel FILE] [--part-size BYTES]
#       here: download the wheel (cached in ~/.cache/colora-ray-kit; --wheel: split FILE instead)
#       and split it into OUT/r1, OUT/r2, ... (OUT defaults to .ray-kit, git-ignored)
#   bash OUT/rN/install.sh [TARGET]
#       on the host, after each part arrives (carry OUT/rN): the last one reassembles the wheel,
#       checks its sha256, installs it into TARGET (default /tmp/colora-ray) with
#       `pip install --no-index --no-deps --target` and prints the PYTHONPATH to export.
set -euo pipefail
OUT=.ray-kit WHEEL="" PART=$((45 * 1024 * 1024))
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) WHEEL=$2; shift 2 ;;
    --part-size) PART=$2; shift 2 ;;
    -*) echo "ray-kit: unknown option $1 (accepted: --wheel FILE, --part-size BYTES)" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
if [ -z "$WHEEL" ]; then
  CACHE=${COLORA_KIT_CACHE:-$HOME/.cache/colora-ray-kit}
  mkdir -p "$CACHE"
  ls "$CACHE"/ray-2.60.0-cp312-*.whl >/dev/null 2>&1 || \
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d "$CACHE" ray==2.60.0
  WHEEL=$(ls "$CACHE"/ray-2.60.0-cp312-*.whl | head -1)
fi
[ -f "$WHEEL" ] || { echo "ray-kit: no wheel at $WHEEL" >&2; exit 2; }
name=$(basename "$WHEEL")
sum=$(sha256sum "$WHEEL" | cut -d' ' -f1)
rm -rf "$OUT" && mkdir -p "$OUT"
split -b "$PART" -d -a 2 "$WHEEL" "$OUT/part."
n=$(ls "$OUT"/part.* | wc -l)
i=0
for part in "$OUT"/part.*; do
  i=$((i + 1)); mkdir -p "$OUT/r$i"; mv "$part" "$OUT/r$i/"
  cat > "$OUT/r$i/install.sh" <<INSTALL
#!/usr/bin/env bash
# Part $i of $n of $name. Run after each part arrives; the last one installs Ray.
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
target=\${1:-/tmp/colora-ray}
parts=\$target.parts
mkdir -p "\$parts"
cp "\$here"/part.* "\$parts"/
have=\$(ls "\$parts"/part.* | wc -l)
if [ "\$have" -lt $n ]; then echo "ray-kit: \$have of $n parts here"; exit 0; fi
if [ ! -f "\$target/.done" ]; then
  cat "\$parts"/part.* > "\$parts/$name"
  [ "\$(sha256sum "\$parts/$name" | cut -d' ' -f1)" = "$sum" ] || { echo "ray-kit: checksum mismatch in \$parts/$name" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target "\$target" "\$parts/$name"
  rm -f "\$parts/$name" && touch "\$target/.done"
fi
echo "ray-kit: ready. export PYTHONPATH=\$target:\\\$PYTHONPATH"
INSTALL
done
du -sh "$OUT"/r*
echo "split $name into $n parts in $OUT; carry $OUT/r1 ... $OUT/r$n one per transfer, running 'bash $OUT/rN/install.sh' after each"
