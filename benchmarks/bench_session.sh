#!/usr/bin/env bash
# The bench alone with the shipped drafter (draftsmith/assets/drafter), in one detached job on the device machine
# (device_bg.sh start, through card_session.sh NEXT=bench), started in the first staging call: it waits for the GGUF,
# then runs h200_run.py bench on SmolLM2 (plain, chain 5, the 4x5x15 tree beside 8x6x48, T=1 against plain sampling
# for each of SAMPLED_TREES, the fp32 check) into OUT/bench. For a budget too short for the pipeline: the same
# drafter as run 14, so the same accept lengths, and what changed since in the engine and drafting shows in speed.
# Environment overrides: SAMPLED_TREES (session_steps.sh), BENCH_FLAGS (more h200_run.py flags).
# usage: bash benchmarks/bench_session.sh OUT GGUF DATA END
set -uo pipefail
out=${1:?usage: bench_session.sh OUT GGUF DATA END} gguf=${2:?GGUF} data=${3:?DATA} end=${4:?END (unix time)}
source "$(dirname "$0")/session_steps.sh" bench  # from /tmp/bench-session-tree; step NAME SECONDS CMD...; OUT/steps.txt
wait_gguf 400 "$gguf"
step bench $(( end - $(date +%s) )) python3 benchmarks/h200_run.py bench --gguf "$gguf" --data "$data" \
  --drafter draftsmith/assets/drafter "${smollm2_bench[@]}" ${BENCH_FLAGS:-} --out "$out/bench"
touch "$out/done"
