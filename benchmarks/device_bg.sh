#!/usr/bin/env bash
# Run one long job on the device machine across several device calls (each at most 10 minutes).
#
# A call's processes die when it returns, except one in its own session (setsid), which runs on
# while the machine stays held. So the first call starts the job detached and later calls, made
# back to back, only wait on it and copy its finished files to $OUT. The job never stops between
# calls, and what each call copies comes back even if the machine is lost later.
#
#   bash benchmarks/device_bg.sh start python3 benchmarks/h200_run.py both ... --out /tmp/pipe/out
#   bash benchmarks/device_bg.sh wait 540 /tmp/pipe/out/config.json   # until the file exists, the job ends, or 540 s (+ the log)
#   bash benchmarks/device_bg.sh fetch train.json answers.jsonl.gz    # files of /tmp/pipe/out to $OUT (+ the log)
set -uo pipefail
PIPE=/tmp/pipe
cmd=${1:?usage: device_bg.sh start CMD... | wait SECONDS [FILE] | fetch NAME...}
shift
case "$cmd" in
  start)
    mkdir -p "$PIPE/out"
    PYTHONUNBUFFERED=1 setsid nohup "$@" >"$PIPE/log" 2>&1 </dev/null &
    echo $! >"$PIPE/pid"
    echo "started pid $(cat "$PIPE/pid"): $*"
    ;;
  wait)
    limit=${1:?seconds}; file=${2:-}
    end=$(( $(date +%s) + limit ))
    while [ "$(date +%s)" -lt "$end" ]; do
      kill -0 "$(cat "$PIPE/pid")" 2>/dev/null || { echo "job ended"; break; }
      [ -n "$file" ] && [ -e "$file" ] && { echo "found $file"; break; }
      sleep 5
    done
    tail -c 6000 "$PIPE/log"
    # The log so far comes back with every wait: a machine taken back later still leaves its timings.
    if [ -n "${OUT:-}" ]; then gzip -c "$PIPE/log" >"$OUT/job.log.gz"; fi  # (no OUT: still exit 0)
    ;;
  fetch)
    for name in "$@"; do
      for f in "$PIPE"/out/$name; do [ -e "$f" ] && cp "$f" "$OUT/"; done
    done
    gzip -c "$PIPE/log" >"$OUT/job.log.gz"
    ls -la "$OUT"
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
