#!/usr/bin/env bash
# Run HERE (where pip reaches a registry) before tools/cuda_check.sh goes to a GPU machine that cannot:
# downloads, into .whl/ (git-ignored), the wheels of our dependencies that the GPU image lacks
# (its python3 3.12 has torch, transformers, safetensors, psutil, jinja2, tqdm, tokenizers).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-common-dir)/info/exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 crc32c==2.9.post0
du -sh .whl
