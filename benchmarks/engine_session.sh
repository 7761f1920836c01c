#!/usr/bin/env bash
# Issue 3's engine figures as one job on the device machine, each step under its own time limit and
# writing under OUT as it goes (a step that fails or runs out of time does not stop the next), most
# wanted first so that a short session cuts the least:
#   1. the GPU tests of decoding (captured chunked prefill, graphed trees and sampling) -> OUT/pytest-gpu-decode.txt
#   2. h200_run.py engine: the SmolLM2 and Llama-3.1-8B shapes (random weights), engine variant by
#      variant: plain tok/s, 1-, 6-, 8- and 49-token passes, each checked against the plain model -> OUT/engine.json
#   3. (only with BENCH_GGUF=PATH set) h200_run.py bench, the command behind h200-decode.json: SmolLM2-135M-
#      Instruct with the shipped drafter (T=0; BENCH_T1=1 adds T=1) on the Triton variant whose SmolLM2-shape
#      plain decoding step 2 found fastest, HF generate, and the 8B shape on compiled and step 2's fastest 8B
#      variant, with the 8B-shape drafter training (split and flex TTT attention) -> OUT/bench/bench.json
#   4. (SLOW=1) every other GPU test of the kernels and the drafter       -> OUT/pytest-gpu.txt
# Run it detached and fetch as it goes (device_bg.sh), e.g. in the last staging call:
#   BENCH_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/device_bg.sh start bash benchmarks/engine_session.sh /tmp/pipe/out
# then in later calls:  bash benchmarks/device_bg.sh wait 540 /tmp/pipe/out/done
#                       bash benchmarks/device_bg.sh fetch steps.txt pytest-gpu-decode.txt engine.json bench/bench.json pytest-gpu.txt
# QUICK_ENGINES="triton" BENCH_GGUF=... [QUICK_TESTS=...] [GREEDY_TREES=...] instead runs only the GPU tests named
# and the real-model bench on each of those engines (see the top of the QUICK_ENGINES branch below).
# usage: bash benchmarks/engine_session.sh OUT [VARIANTS] [SWEEP]
set -uo pipefail
out=${1:?usage: engine_session.sh OUT [VARIANTS] [SWEEP]}
variants=${2:-compiled,triton,triton_pdl,triton_ksplit2,triton_pdl_ksplit2,triton_pdl_ksplit4,triton_pdl_ksplit4_pairs32_split64,triton_sweep}
# triton_sweep's grid (h200_run.py --sweep): 16 tunings around the H100's fastest 8B one (cols=16 and merge_last were slower there)
sweep=${3:-"bk_max=256;pairs=16,32;split=64,256;ksplit=1,4;pdl=0,1"}
source "$(dirname "$0")/session_steps.sh" engine  # from /tmp/engine-session-tree; step NAME SECONDS CMD...; OUT/steps.txt
if [ -n "${QUICK_ENGINES:-}" ]; then
  # QUICK_ENGINES="triton triton_pdl" (with BENCH_GGUF): the GPU tests whose names match QUICK_TESTS (a pytest -k
  # expression; none when unset), then the real-model bench (shipped drafter, T=0 (BENCH_T1=1 adds T=1), no HF, no 8B) on each engine, with
  # the greedy trees of GREEDY_TREES (h200_run.py --greedy-trees, e.g. "4x5x16,8x4x24") beside the main one
  # -> OUT/pytest-gpu-changed.txt, OUT/bench-ENGINE/bench.json (BENCH_LIMIT seconds each, 420 unset; a bench cut by
  # it leaves only smollm2.partial, the figures of the prompts timed so far, every 16); TREE_CYCLE (tree_cycle.py's
  # --variants) first times the tree cycle on random weights for the shapes of TREE_SPECS -> OUT/tree-cycle.json
  if [ -n "${QUICK_TESTS:-}" ]; then  # -v: a test's result is written as it ends, so a step cut by its limit still says which failed
    step pytest-gpu-changed 420 bash -c "set -o pipefail; python3 -m pytest -v --tb=short -m gpu tests/test_decode.py \
      tests/test_kernels.py tests/test_draft.py -k '$QUICK_TESTS' -p no:logging 2>&1 | tee '$out/pytest-gpu-changed.txt'"
  fi
  if [ -n "${TREE_CYCLE:-}" ]; then  # TREE_CYCLE=variants: the tree cycle's cost by variant and shape, random weights
    step tree-cycle 300 python3 benchmarks/tree_cycle.py --variants "$TREE_CYCLE" --specs "${TREE_SPECS:-8x6x48,8x6x47,8x6x31,4x5x15}" \
      --rows 1,16,32,48,49,64 --out "$out/tree-cycle.json"
  fi
  # the GGUF may still be arriving (staging calls after the one that started this job, which assemble it under another
  # name and then mv it into place): wait for it up to GGUF_WAIT seconds (300 unset)
  wait_gguf 300 "${BENCH_GGUF:?QUICK_ENGINES needs BENCH_GGUF}"
  for engine in $QUICK_ENGINES; do
    step "bench-$engine" "${BENCH_LIMIT:-420}" python3 benchmarks/h200_run.py bench --gguf "$BENCH_GGUF" \
      --data "${BENCH_DATA:-/tmp/data}" --drafter draftsmith/assets/drafter --engine "$engine" --no-with-8b --no-hf \
      "$([ "${BENCH_T1:-0}" = 1 ] && echo --t1 || echo --no-t1)" --greedy-trees "${GREEDY_TREES:-}" --out "$out/bench-$engine"
  done
  touch "$out/done"
  exit 0
fi
step pytest-gpu-decode 300 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_decode.py -rA -p no:logging 2>&1 \
  | tee '$out/pytest-gpu-decode.txt'"
step engine 600 python3 benchmarks/h200_run.py engine --sections smollm2_shape,llama8b_shape --variants "$variants" \
  --sweep "$sweep" --rows 1,6,8,49 --out "$out"
if [ -n "${BENCH_GGUF:-}" ]; then
  # the fastest variant that reproduces the plain model, by the SmolLM2 shape's plain tok/s (Triton ones only: the
  # bench's --engine) and by the 8B shape's (any); triton and compiled where engine.json has none
  read -r engine best8b < <(python3 - "$out/engine.json" <<'EOF'
import json, sys
try:
    res = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    res = {}
def best(section, keep):
    rows = {k: v for k, v in res.get(section, {}).items() if isinstance(v, dict) and v.get("matches_reference") and keep(k)}
    return max(rows, key=lambda k: rows[k]["tok_s"]) if rows else None
print(best("smollm2_shape", lambda k: k.startswith("triton")) or "triton_default", best("llama8b_shape", lambda k: True) or "compiled")
EOF
)
  variants8b=compiled; [ "$best8b" != compiled ] && variants8b="compiled,$best8b"
  t1=--no-t1; [ "${BENCH_T1:-0}" = 1 ] && t1="--t1"
  step "bench-$engine" 600 python3 benchmarks/h200_run.py bench --sweep "$sweep" --gguf "$BENCH_GGUF" --data "${BENCH_DATA:-/tmp/data}" \
    --drafter draftsmith/assets/drafter --engine "$engine" --variants "$variants8b" --ttt-paths train_8b,train_8b_flex \
    $t1 --hf --with-8b --out "$out/bench"
fi
if [ "${SLOW:-0}" = 1 ]; then
  step pytest-gpu 600 bash -c "set -o pipefail; python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_draft.py -rs \
    -p no:logging 2>&1 | tee '$out/pytest-gpu.txt'"
fi
touch "$out/done"
