#!/usr/bin/env bash
# Downloads into .whl/ the wheels of the Python packages that bench/gpu/gpu.sh needs and the lent H200
# machine's image lacks (that machine has no internet; gpu.sh installs .whl/*.whl there). Run it
# where pip reaches PyPI, then carry .whl with the working tree:
#
#   bash bench/gpu/gpu_wheels.sh
#
# The list is requirements.txt's run-time packages and their dependencies, less what the image
# has (Python 3.12 with jax 0.11.2, numpy, ml-dtypes, tokenizers, tqdm, protobuf, packaging,
# PyYAML, typing-extensions, torch): zarr and numcodecs with zarr's donfig, hydra-core and
# omegaconf with their antlr4 runtime, google-crc32c, tensorboardX and absl-py (Mosaic GPU imports it).
# One version of each, for CPython 3.12 on manylinux x86_64, without dependencies (each needed one is
# named here).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
DEST=.whl
# Versions pinned in requirements.txt, read from it so that the GPU runs what the tests ran.
FROM_REQUIREMENTS="zarr numcodecs hydra-core omegaconf google-crc32c tensorboardX absl-py"
# Dependencies that requirements.txt does not pin: the versions its pins install here.
DEPENDENCIES="donfig==0.8.1.post1"
# antlr4-python3-runtime 4.9.3 (hydra-core and omegaconf need 4.9.*) is published as source
# only: it is pure Python, so a wheel built here runs anywhere.
BUILT_HERE="antlr4-python3-runtime==4.9.3"
# What a carried set of wheels may weigh: the working tree that travels to the machine is
# limited to 64 MiB in all.
MAX_MIB=48

pinned() {
    local spec
    spec=$(grep -i -E "^$1==" requirements.txt | sed 's/[[:space:]]*#.*//' || true)
    [ -n "$spec" ] || { echo "bench/gpu/gpu_wheels.sh: error: $1 is not pinned (NAME==VERSION) in requirements.txt" >&2; exit 1; }
    echo "$spec"
}

specs=""
for name in $FROM_REQUIREMENTS; do
    specs="$specs $(pinned "$name")"
done
specs="$specs $DEPENDENCIES"

# Downloaded into a new folder that replaces .whl at the end: no stale second version survives.
tmp=$(mktemp -d "$DEST.tmp-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for spec in $specs; do
    echo "downloading $spec" >&2
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" "$spec"
done
for spec in $BUILT_HERE; do
    echo "building $spec" >&2
    "$PYTHON" -m pip wheel -q --no-deps -w "$tmp" "$spec"
done

count=$(find "$tmp" -name '*.whl' | wc -l)
expected=$(echo "$specs $BUILT_HERE" | wc -w)
[ "$count" = "$expected" ] || { echo "bench/gpu/gpu_wheels.sh: error: $count wheels for $expected packages in $tmp" >&2; exit 1; }
size_mib=$(du -sm "$tmp" | cut -f1)
[ "$size_mib" -le "$MAX_MIB" ] || { echo "bench/gpu/gpu_wheels.sh: error: the wheels weigh $size_mib MiB, more than $MAX_MIB" >&2; exit 1; }

rm -rf "$DEST"
mv "$tmp" "$DEST"
ls -l "$DEST"
echo "$count wheels, $(du -sh "$DEST" | cut -f1) in $DEST: carry it with the working tree and run bash bench/gpu/gpu.sh on the GPU machine" >&2
