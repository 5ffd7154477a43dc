#!/usr/bin/env bash
# Candidate demo pairs in one device call, one per GPU: each runs the recipe with its own flags, then the
# speedup protocol on the pair it made (the screen decides between candidates, never the confirmation:
# bench/results/2026-11-29_demo_pair_v2_candidates_356c307/README.md). Each pair comes back as one tar (about 15 MB, under
# the device's 16 MiB a returned file); logs, evals and speedup JSONs as one tgz. From the repository root:
#   FLASHPD_GIT_REV=<rev> bash bench/pair_search.sh "$OUT" "--drafter-steps 10000" "--drafter-intermediate 768"
# Demo pair v2 came from two such candidates at a time on nvidia-h200-x2 (about 9 minutes a call).
set -u
DEST=$1; shift
[ $# -ge 1 ] || { echo "usage: bench/pair_search.sh DEST 'recipe flags' ['recipe flags' ...]" >&2; exit 2; }
i=0
for args in "$@"; do
  OUT=/tmp/cand$i GPU=$i STEPS="pair speedup" PAIR=new RECIPE_ARGS="$args" PAIR_LIMIT=${PAIR_LIMIT:-500} \
    SPEEDUP_LIMIT=${SPEEDUP_LIMIT:-140} TAIL=4 bash bench/h200_battery.sh > /tmp/cand$i.out 2>&1 &
  i=$((i + 1))
  [ $i -lt $# ] && sleep 25  # the first battery installs the package; the others then find it
done
wait
for ((j = 0; j < i; j++)); do
  echo "=== candidate $j"
  grep -v "Warning\|warn(" /tmp/cand$j.out | tail -12
  [ -d /tmp/cand$j/pair ] && tar cf "$DEST/pair$j.tar" -C /tmp/cand$j pair
done
(cd /tmp && tar czf "$DEST/candidates.tgz" cand*.out cand*/make_demo_pair.log cand*/speedup.log cand*/speedup_*.json 2>/dev/null)
ls -la "$DEST"
