#!/usr/bin/env bash
# Re-pack the onnxruntime-gpu wheel that ../shared/device/stage-ort-gpu staged (.ortgpu/p0..pN)
# as an xz tarball of its files, without the TensorRT provider (unused, a third of the size),
# in 4 parts (.ortgpu/q0..q3) instead of 5: one call less of the lent GPU machine's time per
# staging. Run from the repository root, after stage-ort-gpu. The calls, each carrying one part:
#
#   mkdir -p /tmp/ortgpu && cp .ortgpu/qK/* /tmp/ortgpu/             # K = 0, 1, 2
#   mkdir -p /tmp/ortgpu && cp .ortgpu/q3/* /tmp/ortgpu/ && cd /tmp/ortgpu && cat part-0 part-1 part-2 part-3 \
#     > /tmp/ort.tar.xz && python3 -c "import tarfile; tarfile.open('/tmp/ort.tar.xz').extractall('/tmp/ortsite')" \
#     && rm -f /tmp/ort.tar.xz && cd - >/dev/null && bash tools/gpu_check.sh 560
#
# (/tmp/ortsite is where tools/gpu_check.sh imports onnxruntime from.)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat .ortgpu/p*/part-* > "$work/ort.whl"
mkdir "$work/site"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$work/ort.whl" "$work/site"
rm -f "$work"/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
tar -C "$work/site" -cJf "$work/ort.tar.xz" .
rm -rf .ortgpu/q*
size=$(( ($(stat -c %s "$work/ort.tar.xz") + 3) / 4 ))
split -b "$size" -d -a 1 "$work/ort.tar.xz" "$work/part-"
for i in 0 1 2 3; do mkdir -p ".ortgpu/q$i" && mv "$work/part-$i" ".ortgpu/q$i/"; done
(cd "$work" && sha256sum ort.tar.xz) > .ortgpu/q3/SHA
ls -l .ortgpu/q*/part-*
