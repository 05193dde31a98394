#!/usr/bin/env bash
# One call on the GPU machine: kernel tests, then benchmarks; JSON under $OUT, a short table last.
# Usage (device tool): bash bench/gpu_check.sh [--sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/halfbyte-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
timeout 300 python3 bench/gemv.py --json "$OUT/gemv.json" "$@" 2>"$OUT/gemv.err"; tail -c 600 "$OUT/gemv.err"
# end to end, the generic 4-bit kernel and the fp16x2 one in the same run
HALFBYTE_W4_KERNEL=generic python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b_generic.json" 2>&1 | tail -6
python3 bench/decode.py --shape llama3-8b --profile --json "$OUT/decode_8b.json" 2>&1 | tail -40
