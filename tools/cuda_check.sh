#!/usr/bin/env bash
# The CUDA checks of the VRAM tier on a GPU machine, in under 5 minutes (issue: fast expert compute):
#   1. the gpu-marked tests (GPU expert == CPU kernel; VRAM tier greedy-identical with 2 slots to all);
#   2. `bench --kernels --json` (CPU FFN vs memcpy, H2D GB/s, GPU FFN GB/s, side-stream speed-up);
#   3. decode on a small stress model: RAM tier only vs every expert in VRAM, same run.
# Uses the machine's own python3/torch; wheels of what its image lacks come from tools/cuda_wheels.sh.
# Results land in ${OUT:-./cuda-check}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-./cuda-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || true  # the int4 C kernel, optional
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())"

set +e
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 60 python3 -m colibri_stream bench --kernels --json 2>&1 | tee "$out/kernels.log"
timeout 90 python3 tools/cuda_decode.py --out "$out/decode.json" 2>&1 | tee "$out/decode.log"
exit "$tests_rc"
