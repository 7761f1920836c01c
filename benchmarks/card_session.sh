#!/usr/bin/env bash
# One device session's job, by the card that came (device_bg.sh start, in the first staging call):
#   an H200: issue 3's decode session first (decode_session.sh into OUT/decode: the 8B shape, the bench behind
#            h200-decode.json, the GPU tests; its environment overrides pass through), then NEXT with the time
#            left before END (DECODE=0 skips the decode session: a budget too short for both);
#   another card: NEXT, then the GPU tests of the kernels and decoding (PYTEST_K) if 200+ s are left.
# NEXT: "recipe" (the default: recipe_session.sh's arms into OUT/recipe), "pipeline" (pipeline_session.sh into
# OUT/pipeline: the whole pipeline and its bench, with TRAIN_STEPS, BENCH_S, PIPE_FLAGS passed through), "bench"
# (bench_session.sh into OUT/bench: the bench alone with the shipped drafter, BENCH_FLAGS) or "none"; both time
# the T=1 trees of SAMPLED_TREES;
# NEXT_H200 replaces NEXT on an H200 (a budget that holds the decode session and little else: NEXT_H200=none).
# The scripts wait for the GGUF (and the arms for the carried answers) that later staging calls bring.
# usage: bash benchmarks/card_session.sh OUT GGUF DATA END
set -uo pipefail
out=${1:?usage: card_session.sh OUT GGUF DATA END} gguf=${2:?GGUF} data=${3:?DATA} end=${4:?END (unix time)}
here=$(cd "$(dirname "$0")" && pwd)
out=$(realpath -ms "$out")  # the GPU tests below write to it from the session's copy of the repo
mkdir -p "$out"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" >"$out/card.txt"
next=${NEXT:-recipe}
[[ "$card" == *H200* ]] && next=${NEXT_H200:-$next}
case "$next" in
  recipe|pipeline|bench|none) ;;
  *) echo "NEXT (or NEXT_H200) must be recipe, pipeline, bench or none, not $next" >&2; exit 2 ;;
esac
echo "next: $next" >>"$out/card.txt"
[[ "$card" == *H200* && "${DECODE:-1}" != 0 ]] && bash "$here/decode_session.sh" "$out/decode" "$gguf" "$data"
[ "$next" != none ] && bash "$here/${next}_session.sh" "$out/$next" "$gguf" "$data" "$end"
if [[ "$card" != *H200* && "$next" != none ]]; then
  left=$(( end - $(date +%s) ))
  if [ "$left" -gt 200 ]; then
    cd "/tmp/${next}-session-tree" && timeout "$left" bash -c "python3 -m pytest -v --tb=short -m gpu tests/test_kernels.py \
      tests/test_decode.py -k '${PYTEST_K:-not nothing}' -p no:logging >'$out/pytest-gpu.txt' 2>&1"
    echo "pytest-gpu: rc $? with $left s given" >>"$out/card.txt"
  fi
fi
touch "$out/done"
