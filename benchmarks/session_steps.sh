# Sourced by the device session scripts (engine_session.sh, decode_session.sh) after they set $out:
# step NAME SECONDS CMD... runs CMD under a time limit and records its exit status and wall time in
# OUT/steps.txt, which starts with the commit and the time.
step() {
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$out/steps.txt"
  timeout "$limit" "$@"
  echo "== $name: rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"
}
echo "commit ${DRAFTSMITH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} $(date -u +%FT%TZ)" >"$out/steps.txt"
