# Sourced by the device session scripts after they set $out: source "$(dirname "$0")/session_steps.sh" NAME.
# The script goes on from a copy of the repository, /tmp/NAME-session-tree (a later device call re-copies the
# working tree under a running job: a missing module mid-import). NAME is required and a plain word: `source` without
# arguments would hand this file the caller's own $1 (its OUT path). Then
# step NAME SECONDS CMD... runs CMD under a time limit and records its exit status and wall time in
# OUT/steps.txt, which starts with the commit and the time; wait_gguf SECONDS GGUF is the step that waits for
# the GGUF later staging calls assemble (GGUF_WAIT overrides SECONDS); smollm2_bench holds the SmolLM2 bench's
# settings that the pipeline's bench and the bench-only session share (run 14's: their figures compare), with the T=1
# trees they time (SAMPLED_TREES; default 1x2x2, the fastest at T=1 on an H100 at 534bcbf,
# logs/h100-bench-t1-shapes-80-534bcbf.json, and auto, runs 12-14's 4x5x15). OUT, GGUF
# and DATA are made absolute first, so relative paths mean the directory the script was started from.
if [[ ! "${1:-}" =~ ^[a-z0-9]+$ ]]; then
  echo "session_steps.sh: give the session a plain name (source .../session_steps.sh NAME), not '${1:-}'" >&2
  exit 2
fi
out=$(realpath -ms "$out")
[ -n "${gguf:-}" ] && gguf=$(realpath -ms "$gguf")
[ -n "${data:-}" ] && data=$(realpath -ms "$data")
_tree=/tmp/$1-session-tree
rm -rf "$_tree" && cp -r "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "$_tree" && cd "$_tree" || exit 1
mkdir -p "$out"
smollm2_bench=(--num-prompts 80 --no-with-8b --no-hf --topk 4 --tree-steps 5 --tree-tokens 15 --greedy-trees 8x6x48
  --sampled-trees "${SAMPLED_TREES:-1x2x2,auto}")
step() {
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$out/steps.txt"
  timeout "$limit" "$@"
  echo "== $name: rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"
}
wait_gguf() {
  step wait-gguf "${GGUF_WAIT:-$1}" bash -c "until [ -e '$2' ]; do sleep 2; done"
}
echo "commit ${DRAFTSMITH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} $(date -u +%FT%TZ)" >"$out/steps.txt"
