#!/usr/bin/env bash
# Issue 3's engine measurements as one job on the device machine, each step under its own time limit
# and writing under OUT as it goes (a step that fails or runs out of time does not stop the next),
# most wanted first so that a short session cuts the least:
#   1. the GPU test of speculation on the kernels at SmolLM2 widths, every tuning (PDL and a compiled
#      drafter included)                                                 -> OUT/pytest-gpu-widths.txt
#   2. (only with BENCH_GGUF=PATH set) h200_run.py bench: SmolLM2-135M-Instruct with the shipped drafter
#      at T=0 (BENCH_T1=1 adds T=1), once the GGUF at PATH exists (staged by later calls: it waits up
#      to 240 s for it); engine triton_pdl if step 1's pdl-compiled-drafter cases passed, else the
#      default triton                                                    -> OUT/bench/bench.json
#   3. h200_run.py engine: the Llama-3.1-8B shape's Tuning sweep          -> OUT/engine.json
#   4. the other GPU tests of the kernels and decoding                    -> OUT/pytest-gpu.txt
#   5. tree_cycle.py: the SmolLM2 shape's target pass by rows, plain decoding, the host chain and the
#      device-resident tree cycle, engine variant by engine variant       -> OUT/tree-cycle.json
#   6. (issue 4; TTT=0 skips it) the GPU tests of the drafter's TTT attention (flex and split against
#      eager)                                                            -> OUT/pytest-gpu-draft.txt
#      and ttt_attention_bench.py (flex vs split at the training shape)  -> OUT/ttt_attention_bench.json
# Run it detached and fetch as it goes (device_bg.sh), e.g. in the first call:
#   bash benchmarks/device_bg.sh start bash benchmarks/engine_session.sh /tmp/pipe/out
# then in later calls:  bash benchmarks/device_bg.sh wait 540 /tmp/pipe/out/done
#                       bash benchmarks/device_bg.sh fetch steps.txt pytest-gpu-widths.txt bench/bench.json \
#                         engine.json pytest-gpu.txt tree-cycle.json pytest-gpu-draft.txt ttt_attention_bench.json
# usage: bash benchmarks/engine_session.sh OUT [VARIANTS] [SWEEP]
set -uo pipefail
out=${1:?usage: engine_session.sh OUT [VARIANTS] [SWEEP]}
variants=${2:-compiled,triton,triton_torch_head,triton_unsplit,triton_merge_last,triton_ksplit2,triton_pdl,triton_pdl_merge_last}
sweep=${3:-"bk_max=256;pairs=32;split=64,256;cols=0,16;ksplit=1,4;pdl=0,1"}  # 16 tunings (merge_last: slower on the H100)
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
widths=test_speculation_on_cuda_kernels_at_smollm2_widths_equals_plain
step pytest-gpu-widths 420 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_kernels.py -k $widths -rA 2>&1 \
  | tee '$out/pytest-gpu-widths.txt'"
if [ -n "${BENCH_GGUF:-}" ]; then
  engine=triton
  if [ "$(grep -c 'PASSED.*pdl-compiled-drafter' "$out/pytest-gpu-widths.txt")" = 2 ]; then engine=triton_pdl; fi
  t1=--no-t1; [ "${BENCH_T1:-0}" = 1 ] && t1="--t1 --sampled-trees sample,16x6x48:sample,top"
  step "bench-$engine" 420 bash -c "for i in \$(seq 48); do [ -s '$BENCH_GGUF' ] && break; sleep 5; done; \
    python3 benchmarks/h200_run.py bench --gguf '$BENCH_GGUF' --data '${BENCH_DATA:-/tmp/data}' --engine $engine \
    --drafter draftsmith/assets/drafter --no-with-8b --no-hf $t1 --out '$out/bench'"
fi
step engine-8b 600 python3 benchmarks/h200_run.py engine --sections llama8b_shape --variants compiled,triton,triton_sweep \
  --sweep "$sweep" --rows 1,8,49 --out "$out"
step pytest-gpu 420 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_decode.py \
  -k 'not $widths' -rs 2>&1 | tee '$out/pytest-gpu.txt'"
step tree-cycle 720 python3 benchmarks/tree_cycle.py --variants "$variants" --out "$out/tree-cycle.json"
if [ "${TTT:-1}" != 0 ]; then
  step pytest-gpu-draft 240 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_draft.py -rs 2>&1 | tee '$out/pytest-gpu-draft.txt'"
  step ttt-attention 300 python3 benchmarks/ttt_attention_bench.py --out "$out"
fi
touch "$out/done"
