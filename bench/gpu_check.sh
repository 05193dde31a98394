#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then benchmarks; JSON under $OUT, a short table last.
# Usage (device tool): bash bench/gpu_check.sh [--sweep]   (add FULL=1 for the serving, sampling
# and tensor-parallel benchmarks too; each step has a timeout so one hang cannot eat the call)
# With the default GGUF split into .gguf_a/part + .gguf_b/part (carried; see BENCHMARKS.md) and
# the gguf wheel in .whl/, it also runs the GPU-vs-CPU parity check on SmolLM2.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/halfbyte-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# kernels against their references (natively here; CI runs them in Triton's interpreter), then
# the tests marked gpu (GPU engine paths)
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -3
timeout 300 python3 bench/gemv.py --json "$OUT/gemv.json" "$@" 2>"$OUT/gemv.err" | tail -11
python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b.json" 2>&1 | tail -5
if [ -f .gguf_a/part ] && [ -f .gguf_b/part ]; then
  cat .gguf_a/part .gguf_b/part > /tmp/smollm2.gguf
  python3 bench/gpu_parity.py --model /tmp/smollm2.gguf --json "$OUT/parity.json" 2>&1 | tail -4
fi
if [ "${FULL:-0}" = "1" ]; then
  timeout 120 python3 bench/sampling.py --json "$OUT/sampling.json" 2>&1 | tail -6
  timeout 150 python3 bench/tensor_parallel.py --shape llama3-8b --bits 4 --group 128 --steps 128 --repeats 3 \
    --json "$OUT/tp.json" 2>&1 | tail -6
  timeout 240 python3 bench/serving.py --device cuda --shape llama3-8b --out "$OUT/serving.json" 2>&1 | tail -10
  HALFBYTE_PREFILL_ATTENTION=triton timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_prefill_attention.py 2>&1 | tail -2
  HALFBYTE_PREFILL_ATTENTION=triton timeout 90 python3 bench/decode.py --shape llama3-8b 2>&1 | tail -2
fi
