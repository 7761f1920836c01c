#!/usr/bin/env bash
# Issue 4's h200-pipeline.json in one detached job on the device machine (device_bg.sh start), started in the
# first staging call: it waits for the GGUF (later staging calls assemble it), runs the whole pipeline on the
# default recipe (h200_run.py both: regeneration, self-written prompts, one sampled answer to each chat-like and
# self-written prompt, online training at TTT depth 3 with a draft vocab of 8,192, 8,000 steps over padded packs
# with the target's pass compiled (h200_run.py's CUDA defaults): run 20's recipe, export, then the bench: plain, chain 5, the 4x5x15
# tree beside 8x6x48, T=1 sampled trees (SAMPLED_TREES, session_steps.sh), fp32 check) into OUT/pipe, then the GPU
# kernel tests if time is left before END. With TARGET_PROBE=1, first, while the GGUF is still coming,
# benchmarks/target_attn.py times the target's pass over a training pack in each setting (dense or flex mask, eager or
# compiled) and the pipeline trains with the fastest (its train_flags; PIPE_FLAGS come after). Off by default: in
# run 19 it chose flex (2.4x eager sdpa on its ragged packs), and training's steps then took 94.8 ms on average against
# run 18's 94.0 with sdpa (logs/h100-target-attn-d14c00b.json): its ragged figures do not stand for training's packs.
#   END: unix time by which the job must be done (the session's device budget). Training stops checkpointed
#   BENCH_S seconds (default 330) before it so that the bench fits; the tests run only with 150+ s left.
# Each step writes OUT/steps.txt lines (rc, seconds); OUT/done at the end. Environment overrides: TRAIN_STEPS
# (8000, run 20's: ~0.089 s a step on an H100 with the evaluations, 710 s), GEN_SECONDS (generation guard, 700), BENCH_S, PIPE_FLAGS (more
# h200_run.py flags), PYTEST_K.
# usage: bash benchmarks/pipeline_session.sh OUT GGUF DATA END
set -uo pipefail
out=${1:?usage: pipeline_session.sh OUT GGUF DATA END} gguf=${2:?GGUF} data=${3:?DATA} end=${4:?END (unix time)}
source "$(dirname "$0")/session_steps.sh" pipeline  # from /tmp/pipeline-session-tree; step NAME SECONDS CMD...; OUT/steps.txt
target_flags=()
if [ "${TARGET_PROBE:-0}" != 0 ]; then  # random weights: no GGUF needed, so it runs while the staging calls bring it
  step target-attn 120 python3 benchmarks/target_attn.py --packs 6 --reps 3 --out "$out/target-attn.json"
  read -r -a target_flags < <(python3 -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["train_flags"]))' \
    "$out/target-attn.json" 2>/dev/null)
  echo "== target-attn: training with [${target_flags[*]}]" | tee -a "$out/steps.txt"
fi
wait_gguf 400 "$gguf"
step pipeline $(( end - $(date +%s) )) python3 benchmarks/h200_run.py both --gguf "$gguf" --data "$data" \
  --train-steps "${TRAIN_STEPS:-8000}" --gen-seconds "${GEN_SECONDS:-700}" --deadline $(( end - ${BENCH_S:-330} )) \
  "${smollm2_bench[@]}" ${target_flags[@]+"${target_flags[@]}"} ${PIPE_FLAGS:-} --out "$out/pipe"
left=$(( end - $(date +%s) ))
if [ "$left" -gt 150 ]; then
  step pytest-gpu "$left" bash -c "set -o pipefail; python3 -m pytest -v --tb=short -m gpu tests/test_kernels.py \
    -k '${PYTEST_K:-not nothing}' -p no:logging 2>&1 | tee '$out/pytest-gpu.txt'"
fi
touch "$out/done"
