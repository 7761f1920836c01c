#!/usr/bin/env bash
# Issue 4's recipe by measurement in one detached job on the device machine (device_bg.sh start): short training
# runs ("arms") on one carried set of regenerated answers, each changing one thing against the first, every arm the
# same number of steps, judged by the MT-bench score (the simulated accept length on the target's own MT-bench
# answers) and the held-out split. Arms run in the order given and one is skipped when what is left before END
# would not hold it (the longest arm so far, plus a margin), so the most wanted come first.
#   ARMS: "name:flags;name:flags;..." (h200_run.py train flags over the shared ones below); default: run 13's recipe
#   (base: the h200_run.py defaults, TTT depth 3, draft vocab 8,192, every carried answer), then the axes not yet
#   measured at it: the steps' loss weights 0.5^j instead of 0.8^j, TTT depth 2 (scored over 7 steps like the rest),
#   lr 2e-3. The earlier lists are in h200-recipe.json: a44c107's against depth 7 and a 32K vocab
#   (ablation_2026_12_06), a53270c's data mix (ablation_data_mix: no-self "--source-fraction self_prompts=0",
#   no-samples "--extra-samples 0", gsm8k-0.3 "--source-fraction gsm8k=0.3", depth5 "--depth 5").
#   ARM_STEPS: steps an arm (900); ANSWERS: the carried answers.jsonl.gz (/tmp/answers12.jsonl.gz); ARM_FLAGS: more
#   flags for every arm (a CPU smoke: --device cpu --dtype float32 --attn-impl eager ...).
# Each arm writes OUT/<name>/train.json and metrics.jsonl.gz; OUT/arms.tar.gz holds them all (refreshed after each
# arm) and OUT/summary.jsonl one line an arm. OUT/steps.txt as in the other session scripts; OUT/done at the end.
# usage: bash benchmarks/recipe_session.sh OUT GGUF DATA END
set -uo pipefail
out=${1:?usage: recipe_session.sh OUT GGUF DATA END} gguf=${2:?GGUF} data=${3:?DATA} end=${4:?END (unix time)}
answers=${ANSWERS:-/tmp/answers12.jsonl.gz} steps=${ARM_STEPS:-900}
arms=${ARMS:-"base:;decay0.5:--step-decay 0.5;depth2:--depth 2;lr2e-3:--lr 2e-3"}
source "$(dirname "$0")/session_steps.sh" recipe  # from /tmp/recipe-session-tree; step NAME SECONDS CMD...; OUT/steps.txt
step wait-inputs "${INPUT_WAIT:-600}" bash -c "until [ -e '$gguf' ] && [ -e '$answers' ]; do sleep 2; done"
longest=0
IFS=';' read -ra list <<<"$arms"
for arm in "${list[@]}"; do
  name=${arm%%:*} flags=${arm#*:}
  left=$(( end - $(date +%s) ))
  if [ "$left" -lt $(( longest + longest / 10 + 30 )) ] || [ "$left" -lt 90 ]; then
    echo "== $name: skipped, $left s left (longest arm so far $longest s)" | tee -a "$out/steps.txt"
    continue
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086  # flags are words
  step "$name" "$left" python3 benchmarks/h200_run.py train --gguf "$gguf" --data "$data" --answers "$answers" \
    --train-steps "$steps" --deadline "$end" --bring-back metrics --export-vocab 0 --tag="-$name" ${ARM_FLAGS:-} $flags \
    --out "$out/$name"
  took=$(( $(date +%s) - t0 )); [ "$took" -gt "$longest" ] && longest=$took
  python3 - "$out/$name/train.json" "$name" "$flags" "$took" >>"$out/summary.jsonl" <<'EOF'
import json, sys
path, name, flags, took = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError) as e:
    r = {"error": repr(e)}
h = r.get("heldout") or {}
print(json.dumps({"arm": name, "flags": flags, "wall_s": int(took), "steps": r.get("train_steps"),
                  "finished": r.get("finished"), "train_loop_s": r.get("train_loop_s"),
                  "mtbench_score": (h.get("eval_data") or {}).get("accept_length"),
                  "mtbench_score_t1": (h.get("eval_data") or {}).get("accept_length_t1"),
                  "mtbench_sampled_score_t1": (h.get("eval_data_sampled") or {}).get("accept_length_t1"),
                  "heldout_accept_length": h.get("accept_length"), "error": r.get("error")}))
EOF
  tail -1 "$out/summary.jsonl"
  (cd "$out" && tar czf arms.tar.gz --exclude arms.tar.gz -- */)
done
touch "$out/done"
