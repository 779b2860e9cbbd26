#!/usr/bin/env bash
# Build the GPU kit's wheels on this machine (no GPU needed) into benchmarks/gpu/wheels/
# (gitignored; the device tool carries it: carry ["benchmarks/gpu/wheels"]). The GPU machine
# has no network, so everything dsforge needs that its image lacks travels as a wheel:
#   - deepspeed, built from its source distribution (pure Python; its ops compile on the GPU),
#   - every other pin of benchmarks/gpu/requirements.txt, downloaded for CPython 3.12 on
#     x86-64 Linux (glibc 2.28 or older),
#   - dsforge's own wheel (pip resolves its install_requires against the folder there).
# and the real-token corpus every kit run trains on (corpus.py: the Python standard library's
# sources, a 32,000-token BPE trained here with `tokenizers`, `dsforge data prepare`) into
# benchmarks/gpu/wheels/corpus/. Then checks the folder (kit.py --check-wheels) and prints the
# sizes and the total.
# usage: bash benchmarks/gpu/build_kit.sh      (PYTHON=... to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
KIT=benchmarks/gpu
DEST=$KIT/wheels
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

pins=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$KIT/requirements.txt" | grep '==' || true)
source_pins=$(grep '^deepspeed==' <<<"$pins" || true)
binary_pins=$(grep -v '^deepspeed==' <<<"$pins" || true)

echo "build_kit: deepspeed from its source distribution: $source_pins"
"$PY" -m pip wheel --no-deps -w "$TMP" $source_pins

echo "build_kit: binary wheels for CPython 3.12 (x86-64 Linux):" $binary_pins
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$TMP" $binary_pins

echo "build_kit: dsforge's own wheel (from a copy of the working tree: no build/ left here)"
mkdir "$TMP/src"
git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$TMP/src" 2>/dev/null || true
"$PY" -m pip wheel --no-deps -w "$TMP" "$TMP/src"

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: only this build's wheels stay (cache/ is kept)
mv "$TMP"/*.whl "$DEST"/

echo "build_kit: the corpus (benchmarks/gpu/corpus.py; needs tokenizers: pip install -e '.[data]')"
"$PY" "$KIT/corpus.py" --dest "$DEST/corpus"
"$PY" "$KIT/kit.py" --check-wheels
