#!/usr/bin/env bash
# A new user's first hour, timed: fresh clone, empty model cache, `make setup`, `make quickstart`.
#
#   flock /tmp/colorl-cpu.lock bench/first_run.sh [REPO] [WORKDIR]     (extra make arguments: MAKE_ARGS=...)
#
# Prints the set-up and quickstart seconds and the load average, and writes them to
# bench/results/first_run.json of the repository it was started from. The model cache is a new
# empty folder (COLORL_CACHE), so the GGUF conversion is part of the figure; ~/.cache/colorl is untouched.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=${1:-$here}
work=${2:-/tmp/colorl-first-run}
rm -rf "$work" && mkdir -p "$work/cache"
export COLORL_CACHE=$work/cache
git clone -q "$repo" "$work/clone"
cd "$work/clone"
load0=$(cut -d' ' -f1 /proc/loadavg)
s0=$(date +%s.%N)
make setup ${MAKE_ARGS:-}
s1=$(date +%s.%N)
make quickstart ${MAKE_ARGS:-}
s2=$(date +%s.%N)
load1=$(cut -d' ' -f1 /proc/loadavg)
setup=$(echo "$s1 - $s0" | bc)
quick=$(echo "$s2 - $s1" | bc)
echo "setup_s $setup quickstart_s $quick total_s $(echo "$s2 - $s0" | bc) load $load0 -> $load1"
printf '{"date": "%s", "commit": "%s", "setup_s": %s, "quickstart_s": %s, "load_avg_1m": [%s, %s], "make_args": "%s"}\n' \
  "$(date -u +%Y-%m-%dT%H:%M)" "$(git rev-parse --short HEAD)" "$setup" "$quick" "$load0" "$load1" "${MAKE_ARGS:-}" \
  > "$here/bench/results/first_run.json"
