#!/usr/bin/env bash
# One device call for mma_w4: its GPU tests, the GEMV comparison, then the 8B decode with and
# without it (HALFBYTE_W4_KERNEL=mma), alternating. JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/halfbyte-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mma_w4.py 2>&1 | tail -4
timeout "${GEMV_TIMEOUT:-240}" python3 bench/mma_gemv.py ${MMA_ARGS:-} --json "$OUT/mma_gemv.json" 2>&1 | grep -v "^  " | tail -30
for mode in ${DECODE_MODES:-default mma}; do
  if [ "$mode" = mma ]; then export HALFBYTE_W4_KERNEL=mma; else unset HALFBYTE_W4_KERNEL; fi
  echo "decode ($mode)"
  timeout 150 python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_$mode.json" 2>&1 | tail -4
done
