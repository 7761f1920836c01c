#!/usr/bin/env bash
# One device session's job, by the card that came (device_bg.sh start, in the first staging call):
#   an H200: issue 3's decode session first (decode_session.sh into OUT/decode: the 8B shape, the bench behind
#            h200-decode.json, the GPU tests; its environment overrides pass through), then the recipe arms
#            (recipe_session.sh into OUT/recipe) with the time left before END;
#   another card: the recipe arms, then the GPU tests of the kernels and decoding (PYTEST_K) if 200+ s are left.
# Both scripts wait for the GGUF (and the arms for the carried answers) that later staging calls bring.
# usage: bash benchmarks/card_session.sh OUT GGUF DATA END
set -uo pipefail
out=${1:?usage: card_session.sh OUT GGUF DATA END} gguf=${2:?GGUF} data=${3:?DATA} end=${4:?END (unix time)}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" >"$out/card.txt"
if [[ "$card" == *H200* ]]; then
  bash "$here/decode_session.sh" "$out/decode" "$gguf" "$data"
  bash "$here/recipe_session.sh" "$out/recipe" "$gguf" "$data" "$end"
else
  bash "$here/recipe_session.sh" "$out/recipe" "$gguf" "$data" "$end"
  left=$(( end - $(date +%s) ))
  if [ "$left" -gt 200 ]; then
    cd /tmp/recipe-session-tree && timeout "$left" bash -c "python3 -m pytest -v --tb=short -m gpu tests/test_kernels.py \
      tests/test_decode.py -k '${PYTEST_K:-not nothing}' -p no:logging >'$out/pytest-gpu.txt' 2>&1"
    echo "pytest-gpu: rc $? with $left s given" >>"$out/card.txt"
  fi
fi
touch "$out/done"
