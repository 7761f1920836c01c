#!/usr/bin/env bash
# Issue 3's engine measurements as one job on the device machine, each step under its own time limit
# and writing under OUT as it goes (a step that fails or runs out of time does not stop the next):
#   1. the GPU tests of the kernels and decoding                          -> OUT/pytest-gpu.txt
#   2. tree_cycle.py: the SmolLM2 shape's target pass by rows, plain decoding, the host chain and the
#      device-resident tree cycle, engine variant by engine variant       -> OUT/tree-cycle.json
#   3. (only with BENCH_GGUF=PATH set) h200_run.py bench: SmolLM2-135M-Instruct with the shipped drafter,
#      T=0 and T=1 with three sampled trees, once the GGUF at PATH exists (staged by later calls: it
#      waits up to 240 s for it)                                          -> OUT/bench/bench.json
#   4. h200_run.py engine: the Llama-3.1-8B shape's Tuning sweep          -> OUT/engine.json
#   5. (issue 4, last so that a short session cuts it first; TTT=0 skips it) the GPU tests of the
#      drafter's TTT attention (flex and split against eager)           -> OUT/pytest-gpu-draft.txt
#      and ttt_attention_bench.py (flex vs split at the training shape)  -> OUT/ttt_attention_bench.json
# Run it detached and fetch as it goes (device_bg.sh), e.g. in the first call:
#   bash benchmarks/device_bg.sh start bash benchmarks/engine_session.sh /tmp/pipe/out
# then in later calls:  bash benchmarks/device_bg.sh wait 540 /tmp/pipe/out/done
#                       bash benchmarks/device_bg.sh fetch pytest-gpu.txt tree-cycle.json engine.json steps.txt \
#                         pytest-gpu-draft.txt ttt_attention_bench.json
# usage: bash benchmarks/engine_session.sh OUT [VARIANTS] [SWEEP]
set -uo pipefail
out=${1:?usage: engine_session.sh OUT [VARIANTS] [SWEEP]}
variants=${2:-compiled,triton,triton_torch_head,triton_unsplit,triton_merge_last,triton_ksplit2,triton_pdl,triton_pdl_merge_last}
sweep=${3:-"bk_max=256;pairs=32;split=64,256;cols=0,16;ksplit=1,4;merge_last=0,1;pdl=0,1"}  # 32 tunings
mkdir -p "$out"
cd "$(dirname "$0")/.."
step() {  # step NAME SECONDS CMD...: runs CMD, records its exit status and wall time in OUT/steps.txt
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$out/steps.txt"
  timeout "$limit" "$@"
  echo "== $name: rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"
}
echo "commit ${DRAFTSMITH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} $(date -u +%FT%TZ)" >"$out/steps.txt"
step pytest-gpu 420 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_decode.py -rs 2>&1 | tee '$out/pytest-gpu.txt'"
step tree-cycle 720 python3 benchmarks/tree_cycle.py --variants "$variants" --out "$out/tree-cycle.json"
if [ -n "${BENCH_GGUF:-}" ]; then
  step bench 480 bash -c "for i in \$(seq 48); do [ -s '$BENCH_GGUF' ] && break; sleep 5; done; \
    python3 benchmarks/h200_run.py bench --gguf '$BENCH_GGUF' --data '${BENCH_DATA:-/tmp/data}' \
    --drafter draftsmith/assets/drafter --no-with-8b --no-hf --sampled-trees sample,16x6x48:sample,top --out '$out/bench'"
fi
step engine-8b 600 python3 benchmarks/h200_run.py engine --sections llama8b_shape --variants compiled,triton,triton_sweep \
  --sweep "$sweep" --rows 1,8,49 --out "$out"
if [ "${TTT:-1}" != 0 ]; then
  step pytest-gpu-draft 240 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_draft.py -rs 2>&1 | tee '$out/pytest-gpu-draft.txt'"
  step ttt-attention 300 python3 benchmarks/ttt_attention_bench.py --out "$out"
fi
touch "$out/done"
