#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then benchmarks; JSON under $OUT, a short table last.
# Usage (device tool): [STEPS="tests parity decode ..."] bash bench/gpu_check.sh
#   steps: tests (kernels vs references), parity (GPU vs CPU engine on SmolLM2, batched vs alone),
#   decode (8B batch-1 decode + prefill), gemv (per-shape GB/s), read (plain reads of the small shapes' bytes, every grid), gemv_i8 (the int8-x GEMV beside gemv_w4), sampling, tp (tensor-parallel 1
#   vs plain), serving (issue 5's GPU cases), triton_prefill (the opt-in prefill attention kernel),
#   decode_nopdl / profile64_nopdl / gemv_nopdl (the same with HALFBYTE_PDL=0), decode_noi8 (HALFBYTE_W4_I8=0), decode_cluster (HALFBYTE_SPLITK_CLUSTER=1), decode_l2 (HALFBYTE_L2_PREFETCH=$L2_MODE, bulk), decode_head (LM head at $HEAD_BITS, 4), exl2 (exllamav2 0.3.2 on a GPTQ checkpoint of the same shape, after decode: ratios),
#   tp9 (issue 9, >= 2 GPUs: tensor-parallel parity and decode scaling per all-reduce, .evaltext/tokenizer
#   carried; TP_SHAPES / TP_ALLREDUCE / TP_PARITY=0 split it over calls),
#   exl2q (exllamav2's converter on SmolLM2 at issue 3's budgets: ppl / KL beside halfbyte's; GGUF parts + .evaltext).
#   Default: tests parity decode gemv; FULL=1: every step. Each step has a timeout so one hang
#   cannot eat the call. parity needs the default GGUF split into .gguf_a/part + .gguf_b/part
#   (carried in two back-to-back calls, see BENCHMARKS.md) and the gguf wheel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/halfbyte-out}
mkdir -p "$OUT"
if [ "${FULL:-0}" = "1" ]; then
  STEPS=${STEPS:-"tests parity decode sampling tp serving triton_prefill gemv"}
fi
STEPS=${STEPS:-"tests parity decode gemv"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

step_tests() {  # natively here; CI runs the same tests in Triton's interpreter
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py tests/test_sampling_candidates.py tests/test_sampling_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
}
# the two GGUF halves travel in two calls (64 MiB each); the first half waits in /tmp, which
# outlives a call on a warm machine (a carried folder not named again does not)
[ -f .gguf_a/part ] && cp .gguf_a/part /tmp/halfbyte_gguf_a
assemble_gguf() {  # -> /tmp/smollm2.gguf from the two halves, or false
  [ -f /tmp/smollm2.gguf ] && return 0
  [ -f /tmp/halfbyte_gguf_a ] && [ -f .gguf_b/part ] && cat /tmp/halfbyte_gguf_a .gguf_b/part > /tmp/smollm2.gguf.part \
    && mv /tmp/smollm2.gguf.part /tmp/smollm2.gguf
}
step_parity() {
  if assemble_gguf; then
    timeout 300 python3 bench/gpu_parity.py --model /tmp/smollm2.gguf --json "$OUT/parity.json" 2>&1 | tail -5
  else
    echo "parity: NOT RUN (the GGUF parts are not both here)"
  fi
}
step_decode() {
  timeout 150 python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b.json" 2>&1 | tail -5
}
step_decode_nopdl() {  # the same decode without programmatic dependent launch (HALFBYTE_PDL=0)
  HALFBYTE_PDL=0 timeout 150 python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b_nopdl.json" 2>&1 | tail -5
}
step_decode_noi8() {  # the same decode without the norms writing int8 planes for gemv_w4_i8 (HALFBYTE_W4_I8=0)
  HALFBYTE_W4_I8=0 timeout 150 python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b_noi8.json" 2>&1 | tail -5
}
step_decode_cluster() {  # the same decode with the split-K combines through thread-block clusters
  HALFBYTE_SPLITK_CLUSTER=1 timeout 150 python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b_cluster.json" 2>&1 | tail -5
}
step_decode_l2() {  # the same decode with the next GEMV's weights asked into the L2 before the small kernels
  HALFBYTE_L2_PREFETCH=${L2_MODE:-bulk} timeout 150 python3 bench/decode.py --shape llama3-8b --json "$OUT/decode_8b_l2.json" 2>&1 | tail -5
}
step_decode_head() {  # the same decode with the LM head quantized to HEAD_BITS (4) bits
  timeout 150 python3 bench/decode.py --shape llama3-8b --head-bits "${HEAD_BITS:-4}" --json "$OUT/decode_8b_head.json" 2>&1 | tail -5
}
step_norm() {  # the RMSNorm kernel for one row: columns per program, and writing int8 planes beside it
  timeout 120 python3 bench/norm_planes.py --json "$OUT/norm_planes.json" 2>&1 | tail -16
}
step_exl2() {  # after decode in the same call: STEPS="decode exl2"; needs .whl/exllamav2-0.3.2-py3-none-any.whl
  timeout 480 python3 bench/exllamav2_compare.py --json "$OUT/exl2.json" --halfbyte-json "$OUT/decode_8b.json" 2>&1 | tail -8
}
step_exl2q() {  # exllamav2's converter on SmolLM2 at issue 3's budgets; needs the GGUF halves and .evaltext/windows.json
  if assemble_gguf; then
    timeout "${EXL2Q_TIMEOUT:-540}" python3 bench/exl2_quality.py --gguf /tmp/smollm2.gguf --budgets "${EXL2Q_BUDGETS:-4.25,3.25,2.5}" \
      --json "$OUT/exl2_quality.json" 2>&1 | tail -8
  else
    echo "exl2q: NOT RUN (the GGUF parts are not both here)"
  fi
}
step_profile64() {
  timeout 150 python3 bench/decode.py --shape llama3-8b --profile-batch 64 --context 512 > "$OUT/profile64.txt" 2>&1
  grep -E "graphed decode step|Self CUDA time total|Self CPU time total" "$OUT/profile64.txt"
}
step_profile64_nopdl() {
  HALFBYTE_PDL=0 timeout 150 python3 bench/decode.py --shape llama3-8b --profile-batch 64 --context 512 2>&1 | grep "graphed decode step"
}
step_attention() {
  timeout 120 python3 bench/attention.py --json "$OUT/attention.json" 2>&1 | tail -4
}
step_gemv() {
  timeout "${GEMV_TIMEOUT:-300}" python3 bench/gemv.py --json "$OUT/gemv.json" ${GEMV_ARGS:-} 2>"$OUT/gemv.err" | tail -${GEMV_TAIL:-11}
}
step_read() {  # a plain read of the small GEMVs' bytes, every grid (one tile per program at 8-32 words per thread)
  timeout 200 python3 bench/read_ceiling.py ${READ_ARGS---all} --mb ${READ_MB:-8.9 13.4 31.2} 2>&1 | tail -${READ_TAIL:-80}
}
step_gemv_i8() {  # gemv_w4_i8 (x as int8 planes, dp4a) beside gemv_w4, one row
  timeout "${GEMV_TIMEOUT:-300}" python3 bench/gemv_i8.py --json "$OUT/gemv_i8.json" ${GEMV_I8_ARGS:-} 2>"$OUT/gemv_i8.err" | tail -10
}
step_gemv_nopdl() {
  HALFBYTE_PDL=0 timeout 300 python3 bench/gemv.py --json "$OUT/gemv_nopdl.json" ${GEMV_ARGS:-} 2>"$OUT/gemv_nopdl.err" | tail -11
}
step_sampling() {
  timeout 120 python3 bench/sampling.py --json "$OUT/sampling.json" 2>&1 | tail -6
}
step_tp() {
  timeout 150 python3 bench/tensor_parallel.py --shape llama3-8b --bits 4 --group 128 --steps 128 --repeats 3 \
    --json "$OUT/tp.json" 2>&1 | tail -6
}
step_tp9() {  # issue 9, >= 2 GPUs: engine parity, then decode at 1 and TP_SIZES ranks, per all-reduce (TP_ALLREDUCE)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # NVLink multicast off (GPU machine notes)
  local sizes=${TP_SIZES:-2} modes=${TP_ALLREDUCE:-"nccl symm"}
  for mode in $modes; do
    [ "${TP_PARITY:-1}" = 1 ] && HALFBYTE_TP_ALLREDUCE=$mode timeout 300 python3 bench/tp_parity.py --sizes "$sizes" \
      --json "$OUT/tp_parity_$mode.json" 2>&1 | tee "$OUT/tp_parity_$mode.log" | grep -E "tensor_parallel_size|Error" | tail -4
  done
  for shape in ${TP_SHAPES:-llama3-8b llama3-70b}; do
    local kv=0
    [ "$shape" = llama3-70b ] && kv=32768  # the 70B shape with a 32k-token KV pool: memory per GPU
    for run in 1:nccl $(for n in ${sizes//,/ }; do for m in $modes; do echo "$n:$m"; done; done); do
      local n=${run%%:*} mode=${run##*:}
      HALFBYTE_TP_ALLREDUCE=$mode timeout 240 python3 -m torch.distributed.run --nproc-per-node "$n" \
        bench/tensor_parallel.py --shape "$shape" --bits 4 --group 128 --steps 128 --repeats 3 --kv-tokens "$kv" \
        --json "$OUT/tp_${shape}_${n}_$mode.json" 2>&1 | tee "$OUT/tp_${shape}_${n}_$mode.log" | grep -E '^\{|Error' | tail -2
    done
  done
}
step_serving() {
  timeout "${SERVING_TIMEOUT:-240}" python3 bench/serving.py --device cuda --shape llama3-8b \
    --out "$OUT/serving.json" ${SERVING_ARGS:-} 2>&1 | tail -12
}
step_triton_prefill() {
  HALFBYTE_PREFILL_ATTENTION=triton timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_prefill_attention.py 2>&1 | tail -2
  HALFBYTE_PREFILL_ATTENTION=triton timeout 90 python3 bench/decode.py --shape llama3-8b 2>&1 | tail -2
}
for s in $STEPS; do
  echo "== $s ($(date +%T))"
  "step_$s"
done
echo "== done ($(date +%T))"
