#!/usr/bin/env bash
# Online training's step time in each setting of the target's pass, on one card and the same packs: eager sdpa (runs
# 18-19), and padded packs with the pass compiled (--pad-packs --target-compile) over sdpa and over flex. The data is
# ANSWERS (generate's answers.jsonl) repeated until one epoch holds STEPS steps; the drafter is run 19's recipe (TTT
# depth 3, draft vocab 8,192). Each arm trains STEPS steps; OUT/train-ab.json has each arm's mean and median step
# seconds after step WARM (compilation comes first) and its last training losses (the arms must agree).
# Environment: ARMS (space-separated, default "eager compiled compiled_flex"), DEVICE (cuda), WARM (50), EXTRA (more
# train flags).
# TARGET: the GGUF (or any target draftsmith loads), or a folder with a config and tokenizer only (as
# .device-data/ab/smollm2-shape, written from the GGUF by transformers), given random bf16 weights here: the step
# time is the same, and no GGUF has to be staged.
# usage: bash benchmarks/train_ab.sh OUT TARGET ANSWERS [STEPS]
set -uo pipefail
out=${1:?usage: train_ab.sh OUT TARGET ANSWERS [STEPS]} target=${2:?TARGET} answers=${3:?ANSWERS} steps=${4:-300}
mkdir -p "$out"
if [ -d "$target" ] && ! ls "$target"/*.safetensors >/dev/null 2>&1; then
  rm -rf "$out/target" && cp -r "$target" "$out/target" && target=$out/target
  python3 -c "import sys, torch, transformers
torch.manual_seed(0)
cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])" "$target" || exit 1
fi
rows=$(wc -l <"$answers")
copies=$(( steps * 8 * 2048 / (rows * 200) + 1 ))  # ~200 tokens an answer at the least
for _ in $(seq "$copies"); do cat "$answers"; done >"$out/answers.jsonl"
declare -A flags=([eager]="" [compiled]="--pad-packs --target-compile" [compiled_flex]="--pad-packs --target-compile --target-attn flex")
for arm in ${ARMS:-eager compiled compiled_flex}; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  python3 -m draftsmith train --target "$target" --data "$out/answers.jsonl" --online --out "$out/$arm" --ttt-depth 3 \
    --eval-depth 7 --draft-vocab-size 8192 --lr 1e-3 --epochs 1 --max-steps "$steps" --eval-fraction 0.002 \
    --save-every 100000 --device "${DEVICE:-cuda}" ${flags[$arm]} ${EXTRA:-} >"$out/$arm.log" 2>&1
  echo "$arm rc $? in $(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$start") s" | tee -a "$out/arms.txt"
done
python3 - "$out" "${WARM:-50}" <<'EOF'
import json, pathlib, statistics, sys
out, warm = pathlib.Path(sys.argv[1]), int(sys.argv[2])
res = {}
for arm in sorted(p.parent.name for p in out.glob("*/metrics.jsonl")):
    rows = [json.loads(line) for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    timed = [r["seconds"] for r in steps if r["step"] > warm]
    res[arm] = {"steps": len(steps), "first_steps_s": round(sum(r["seconds"] for r in steps if r["step"] <= warm), 2),
                "mean_step_ms": round(1e3 * statistics.mean(timed), 2) if timed else None,
                "median_step_ms": round(1e3 * statistics.median(timed), 2) if timed else None,
                "tokens_per_step": round(statistics.mean(r["tokens"] for r in steps), 1) if steps else None,
                "last_loss": steps[-1]["loss"] if steps else None}
(out / "train-ab.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
EOF
