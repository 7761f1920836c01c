#!/usr/bin/env bash
# Split a file too big for one device call (the SmolLM2 GGUF, 98 MB) into N parts under
# .device-stage/p0 .. p{N-1} (git-ignored), and print the N back-to-back device calls that rebuild it
# in /tmp there. Like ../shared/tools/stage-for-device, for any N: the tracked tree travels with every
# call, so the bigger it is, the more parts the file needs to keep each call under 64 MiB.
#
# usage: bash benchmarks/stage_parts.sh FILE N       (from the repository root)
set -euo pipefail
file=${1:?usage: stage_parts.sh FILE N}; n=${2:?usage: stage_parts.sh FILE N}
root=$(git rev-parse --show-toplevel)
grep -qx '/.device-stage/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device-stage/' >>"$root/.git/info/exclude"
rm -rf "$root/.device-stage"
name=$(basename "$file")
sum=$(sha256sum "$file" | cut -d' ' -f1)
tmp=$(mktemp -d)
split -n "$n" -d -a 1 "$file" "$tmp/$name.part"
for i in $(seq 0 $((n - 1))); do
  mkdir -p "$root/.device-stage/p$i"
  mv "$tmp/$name.part$i" "$root/.device-stage/p$i/"
done
rmdir "$tmp"
tree_mb=$(git -C "$root" ls-files -z | (cd "$root" && xargs -0 du -cb) | tail -1 | cut -f1)
echo "Staged $name in $n parts of $(du -b "$root/.device-stage/p0/$name.part0" | cut -f1) bytes; the tracked tree adds $tree_mb bytes to each call."
echo "Make these calls back to back (each within ~30 s of the last):"
for i in $(seq 0 $((n - 2))); do
  echo " $((i + 1))) carry [\".device-stage/p$i\"]  command: mkdir -p /tmp/stage && cp .device-stage/p$i/* /tmp/stage/"
done
last=$((n - 1))
echo " $n) carry [\".device-stage/p$last\", ...]  command: cp .device-stage/p$last/* /tmp/stage/ && cat /tmp/stage/$name.part* > /tmp/$name && echo \"$sum  /tmp/$name\" | sha256sum -c - && <your run>"
