#!/usr/bin/env bash
# Whether two builds of librl_engine_sm90.so carry the same device code: their .nv_fatbin sections
# (every kernel's cubin, as nvcc embedded it) byte for byte. No GPU and no cuobjdump needed. For a
# change of csrc/ that should move host code only (a refactor of the launch configurations, the
# C ABI's checks): equal device code means the GPU tests and timings of the old build hold for
# the new one.
#   bash scripts/csrc_same_device_code.sh OLD.so NEW.so   # exit 0: the same; 1: they differ
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 OLD.so NEW.so" >&2
  exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for i in 1 2; do
  lib=${!i}
  if ! objcopy -O binary --only-section=.nv_fatbin "$lib" "$tmp/$i.bin" 2>"$tmp/err" \
    || [ ! -s "$tmp/$i.bin" ]; then
    echo "$lib: no .nv_fatbin section ($(cat "$tmp/err"))" >&2
    exit 2
  fi
done
a=$(sha256sum < "$tmp/1.bin" | cut -c1-16)
b=$(sha256sum < "$tmp/2.bin" | cut -c1-16)
if [ "$a" = "$b" ]; then
  echo "same device code ($(stat -c %s "$tmp/1.bin") bytes of fatbin, sha256 $a)"
else
  echo "device code differs: $1 $a, $2 $b"
  exit 1
fi
