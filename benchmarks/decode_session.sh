#!/usr/bin/env bash
# Issue 3's h200-decode.json in one detached job on the device machine (device_bg.sh start), most wanted first:
#   1. the Llama-3.1-8B shape (random weights): the default Tuning, and a sweep around it (early weights for every
#      pass or for one-token steps only)
#      -> OUT/engine8b/engine.json
#   2. once the GGUF is in place (later staging calls assemble it): h200_run.py bench, the command behind
#      h200-decode.json, on the Triton tuning a sweep on SmolLM2's own weights finds fastest (its table in
#      bench.json's engine_sweep), with HF generate, the 8B and SmolLM2 shapes (compiled, the default) and the
#      4x5x15 tree beside 8x6x48 -> OUT/bench/bench.json
#   3. the GPU tests of the kernels and decoding -> OUT/pytest-gpu.txt
# Each step writes OUT/steps.txt lines (rc, seconds); OUT/done at the end. Environment overrides (defaults: the
# run of 2026-12-06 at 6bd8ada, less Tuning.gate_ksplit, since removed): SECTIONS, ENGINE_VARIANTS, ROWS, SWEEP_8B
# (step 1's sections, variants, pass sizes and sweep), SWEEP_SMOLLM2, BENCH_VARIANTS, BENCH_FLAGS (step 2's sweep,
# shape variants, and "--hf --with-8b"), PYTEST_K and PYTEST_S (step 3's -k and time limit, 480 s; 0 skips it).
# usage: bash benchmarks/decode_session.sh OUT GGUF DATA
set -uo pipefail
out=${1:?usage: decode_session.sh OUT GGUF DATA} gguf=${2:?GGUF} data=${3:?DATA}
source "$(dirname "$0")/session_steps.sh" decode  # from /tmp/decode-session-tree; step NAME SECONDS CMD...; OUT/steps.txt
step engine "${ENGINE_LIMIT:-300}" python3 benchmarks/h200_run.py engine --sections "${SECTIONS:-llama8b_shape}" \
  --variants "${ENGINE_VARIANTS:-triton_default,triton_default_nopdl,triton_sweep}" --rows "${ROWS:-1,8}" \
  --sweep "${SWEEP_8B:-bk_max=256;slots=128;early_rows=0,1}" --out "$out/engine8b"
wait_gguf 300 "$gguf"
step bench "${BENCH_LIMIT:-900}" python3 benchmarks/h200_run.py bench --gguf "$gguf" --data "$data" \
  --drafter draftsmith/assets/drafter --engine triton_sweep \
  --sweep "${SWEEP_SMOLLM2:-bk_max=256;slots=128;warps=2,4;split=32,64;merge_last=0,1}" \
  --variants "${BENCH_VARIANTS:-compiled,triton_default}" --ttt-paths "" --no-t1 ${BENCH_FLAGS:---hf --with-8b} \
  --greedy-trees 4x5x15 --out "$out/bench"
[ "${PYTEST_S:-480}" -gt 0 ] && step pytest-gpu "${PYTEST_S:-480}" bash -c "set -o pipefail; python3 -m pytest -v --tb=short -m gpu tests/test_kernels.py tests/test_decode.py \
  -k '${PYTEST_K:-not nothing}' -p no:logging 2>&1 | tee '$out/pytest-gpu.txt'"
touch "$out/done"
